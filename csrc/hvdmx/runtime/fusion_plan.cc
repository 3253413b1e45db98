#include "runtime/fusion_plan.h"

namespace hvdmx {
namespace {

bool Fusable(const Response& r) { return r.type == CollectiveType::kAllreduce && r.error.empty(); }

bool SameReduction(const Response& a, int ta, const Response& b, int tb) {
  return a.dtypes[ta] == b.dtypes[tb] && a.op == b.op && a.scale == b.scale;
}

}  // namespace

std::vector<FusionGroup> PlanFusion(const std::vector<Response>& responses, int64_t threshold,
                                    int64_t max_tensor_bytes) {
  std::vector<FusionGroup> groups;
  FusionGroup open;
  const Response* open_first = nullptr;
  int open_first_tensor = 0;
  bool open_fusable = true;
  auto close = [&] {
    if (!open.items.empty()) groups.push_back(std::move(open));
    open = FusionGroup();
    open_first = nullptr;
  };
  for (int r = 0; r < static_cast<int>(responses.size()); ++r) {
    const Response& response = responses[r];
    if (!Fusable(response)) {
      close();
      FusionGroup alone;
      alone.items.push_back({r, -1});
      groups.push_back(std::move(alone));
      continue;
    }
    for (int t = 0; t < static_cast<int>(response.counts.size()); ++t) {
      const int64_t bytes =
          response.counts[t] * static_cast<int64_t>(DataTypeSize(response.dtypes[t]));
      // A tensor too large to fuse neither joins a group nor lets one join it.
      const bool fusable = bytes <= max_tensor_bytes;
      const bool fits = open_first != nullptr && fusable && open_fusable &&
                        SameReduction(*open_first, open_first_tensor, response, t) &&
                        open.bytes + bytes <= threshold;
      if (!fits) {
        close();
        open_first = &response;
        open_first_tensor = t;
        open_fusable = fusable;
      }
      open.items.push_back({r, t});
      open.bytes += bytes;
    }
  }
  close();
  return groups;
}

}  // namespace hvdmx
