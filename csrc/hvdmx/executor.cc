#include "executor.h"

#include <cstring>

#include "reduce_kernels.h"

namespace hvdmx {

namespace {

// The implementation for a message of `bytes`, before the dtype is known to
// MPI. See "The MPI path, and how auto chooses" in docs/algorithms.md.
AllreduceAlgo ChooseAllreduce(const Config& config, int64_t bytes, bool shm_on) {
  switch (config.allreduce_algo) {
    case AllreduceAlgo::kAuto:
      if (shm_on) return bytes >= config.shm_min_bytes ? AllreduceAlgo::kShm : AllreduceAlgo::kMpi;
      return bytes >= config.ring_min_bytes ? AllreduceAlgo::kRing : AllreduceAlgo::kMpi;
    case AllreduceAlgo::kShm:
      return shm_on ? AllreduceAlgo::kShm : AllreduceAlgo::kRing;
    default:
      return config.allreduce_algo;
  }
}

}  // namespace

void Executor::Allreduce(void* buf, int64_t count, DataType dtype, ReduceOp op) {
  if (comm_.size() == 1 || count == 0) return;
  const int64_t bytes = count * static_cast<int64_t>(DataTypeSize(dtype));
  AllreduceAlgo algo = ChooseAllreduce(config_, bytes, shm_ != nullptr);
  if (algo == AllreduceAlgo::kMpi) {
    if (comm_.NativeAllreduce(buf, count, dtype, op)) return;
    // MPI has no float16/bfloat16 reductions: those take shared memory
    // where auto would use it, else the ring.
    const bool shm_ok = shm_ != nullptr && config_.allreduce_algo == AllreduceAlgo::kAuto;
    algo = shm_ok ? AllreduceAlgo::kShm : AllreduceAlgo::kRing;
  }
  if (algo == AllreduceAlgo::kShm) {
    shm_->Allreduce(buf, count, dtype, op);
    return;
  }
  RingAllreduce(comm_, buf, count, dtype, op, config_.ring_segment_bytes, &ring_scratch_);
}

void Executor::Run(const std::vector<Response>& responses, TensorQueue* queue) {
  // Take every entry first: the groups below address them by response index.
  std::vector<TensorEntry> entries;
  std::vector<int> remaining;
  entries.reserve(responses.size());
  for (const Response& response : responses) {
    entries.push_back(queue->Take(response.name));
    remaining.push_back(static_cast<int>(response.counts.size()));
  }
  for (const FusionGroup& group : PlanFusion(responses, config_.fusion_threshold)) {
    const int first = group.items[0].response;
    const Response& response = responses[first];
    if (!response.error.empty()) {
      entries[first].callback(Status::Mismatch(response.error));
      continue;
    }
    if (response.type == CollectiveType::kBroadcast) {
      RunBroadcast(response, entries[first]);
      entries[first].callback(Status::Ok());
      continue;
    }
    RunAllreduceGroup(group, responses, entries);
    for (const FusionGroup::Item& item : group.items) {
      if (--remaining[item.response] == 0) entries[item.response].callback(Status::Ok());
    }
  }
  // Units with no tensors at all (an empty grouped call) are done at once.
  for (size_t r = 0; r < responses.size(); ++r) {
    if (responses[r].counts.empty() && responses[r].error.empty() &&
        responses[r].type == CollectiveType::kAllreduce) {
      entries[r].callback(Status::Ok());
    }
  }
}

void Executor::RunAllreduceGroup(const FusionGroup& group, const std::vector<Response>& responses,
                                 std::vector<TensorEntry>& entries) {
  const Response& head = responses[group.items[0].response];
  const DataType dtype = head.dtypes[group.items[0].tensor];
  const int64_t elem = static_cast<int64_t>(DataTypeSize(dtype));
  double postscale = head.postscale;
  if (head.op == ReduceOp::kAverage) postscale /= comm_.size();

  if (group.items.size() == 1) {
    // One tensor: reduce straight in its output, no fusion copy.
    const FusionGroup::Item& item = group.items[0];
    TensorEntry& entry = entries[item.response];
    const int64_t count = head.counts[item.tensor];
    void* out = entry.outputs[item.tensor];
    if (out != entry.inputs[item.tensor] && count > 0) {
      std::memcpy(out, entry.inputs[item.tensor], count * elem);
    }
    ScaleBuffer(out, count, dtype, head.prescale);
    Allreduce(out, count, dtype, head.op);
    ScaleBuffer(out, count, dtype, postscale);
    return;
  }

  char* buffer = fusion_.Get(group.bytes);
  int64_t offset = 0;
  for (const FusionGroup::Item& item : group.items) {
    const int64_t bytes = responses[item.response].counts[item.tensor] * elem;
    if (bytes) std::memcpy(buffer + offset, entries[item.response].inputs[item.tensor], bytes);
    offset += bytes;
  }
  const int64_t count = group.bytes / elem;
  ScaleBuffer(buffer, count, dtype, head.prescale);
  Allreduce(buffer, count, dtype, head.op);
  ScaleBuffer(buffer, count, dtype, postscale);
  offset = 0;
  for (const FusionGroup::Item& item : group.items) {
    const int64_t bytes = responses[item.response].counts[item.tensor] * elem;
    if (bytes) std::memcpy(entries[item.response].outputs[item.tensor], buffer + offset, bytes);
    offset += bytes;
  }
}

void Executor::RunBroadcast(const Response& response, TensorEntry& entry) {
  for (size_t t = 0; t < response.counts.size(); ++t) {
    const int64_t bytes = response.counts[t] * static_cast<int64_t>(DataTypeSize(response.dtypes[t]));
    if (bytes == 0) continue;
    if (comm_.rank() == response.root && entry.outputs[t] != entry.inputs[t]) {
      std::memcpy(entry.outputs[t], entry.inputs[t], bytes);
    }
    comm_.Bcast(entry.outputs[t], bytes, response.root);
  }
}

}  // namespace hvdmx
