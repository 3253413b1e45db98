#include "job/shm_wiring.h"

#include "algorithms/ring.h"
#include "base/logging.h"
#include "job/comm_wiring.h"
#include "job/host_split.h"
#include "shm/shm_segment.h"

namespace hvdmx {
namespace {

// The ring between hosts for a hierarchical allreduce: over the ranks of
// `group` with this rank's local rank. Collective over `group`.
ShmAllreduce::CrossAllreduce RingAcrossHosts(Group& group, int local_rank, const Config& config,
                                             bool busy) {
  std::unique_ptr<Group> cross = group.Split(local_rank, group.rank());
  std::shared_ptr<Comm> ring = CommOver(*cross, config, busy, CommUse::kData);
  auto scratch = std::make_shared<RingScratch>();
  const int64_t segment_bytes = config.ring_segment_bytes;
  const bool wide_partials = config.half_partials_wide;
  return [ring, scratch, segment_bytes, wide_partials](
             void* buf, float* wide, int64_t count, DataType dtype, ReduceOp op, double postscale) {
    RingCrossAllreduce(*ring, buf, wide, count, dtype, op, postscale, wide_partials, segment_bytes,
                       scratch.get());
  };
}

}  // namespace

std::unique_ptr<ShmHost> CreateHostShm(Group& group, const HostMap& hosts, const Config& config,
                                       bool busy) {
  if (config.allreduce_algo != AllreduceAlgo::kAuto &&
      config.allreduce_algo != AllreduceAlgo::kShm) {
    return nullptr;
  }
  const int rank = group.rank(), size = group.size();
  const int local_rank = hosts.local_rank(rank), local_size = hosts.local_size(rank);
  const int fewest = hosts.min_host_size(), most = hosts.max_host_size();
  const bool one_host = local_size == size;
  // Unset, it is hierarchical wherever the hosts allow: measured across test
  // hosts at 2 x 2 ranks, the ResNet-50 gradient set took 152 ms against the
  // flat ring's 232 (docs/benchmarks.md, "Many hosts").
  const bool wanted = config.hierarchical_allreduce || !config.hierarchical_allreduce_set;
  const bool hierarchical = !one_host && wanted && fewest == most && local_size > 1;
  if (size == 1 || (!one_host && !hierarchical)) {
    if (config.hierarchical_allreduce && !one_host) {
      HVDMX_LOG(kWarning) << "HVDMX_HIERARCHICAL_ALLREDUCE=1 ignored, the ring is used: it needs "
                          << "the same number of ranks, more than one, on every host (here "
                          << fewest << " to " << most << ")";
    }
    HVDMX_LOG(kDebug) << "shared-memory allreduce off: " << size << " rank(s), " << local_size
                      << " on this host";
    return nullptr;
  }
  std::unique_ptr<Group> local = SplitByHostMap(group, hosts);
  return CreateShmHost(group, *local, config, hierarchical, [&group, local_rank, &config, busy] {
    return RingAcrossHosts(group, local_rank, config, busy);
  });
}

}  // namespace hvdmx
