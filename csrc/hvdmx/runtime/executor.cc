#include "runtime/executor.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "algorithms/exchange_allreduce.h"
#include "algorithms/reduce_kernels.h"
#include "base/timeline.h"

namespace hvdmx {

namespace {

// The implementation for a message of `bytes`; a dtype that MPI cannot
// reduce is moved off MPI afterwards. See "How the algorithm is chosen, and
// the MPI path" in docs/algorithms.md.
AllreduceAlgo ChooseAllreduce(const Config& config, int64_t bytes, bool shm_on) {
  switch (config.allreduce_algo) {
    case AllreduceAlgo::kAuto:
      if (shm_on)
        return bytes >= config.shm_min_bytes ? AllreduceAlgo::kShm : AllreduceAlgo::kNative;
      return bytes >= config.ring_min_bytes ? AllreduceAlgo::kRing : AllreduceAlgo::kNative;
    case AllreduceAlgo::kShm: return shm_on ? AllreduceAlgo::kShm : AllreduceAlgo::kRing;
    default: return config.allreduce_algo;
  }
}

}  // namespace

const char* Executor::Allreduce(void* buf, int64_t count, DataType dtype, ReduceOp op,
                                Scale scale) {
  // float16 and bfloat16 are summed in float32 on every path; see Note
  // [Half precision summed in float32] in reduce_kernels.cc.
  const bool half = HalfReducesWide(dtype);
  if (comm_.size() == 1 || count == 0) {
    if (half) return AllreduceWide(buf, count, dtype, op, scale, false);
    ScaleBuffer(buf, count, dtype, scale.pre);
    ScaleBuffer(buf, count, dtype, scale.post);
    return "LOCAL_ALLREDUCE";
  }
  const int64_t bytes = count * static_cast<int64_t>(DataTypeSize(dtype));
  AllreduceAlgo algo = ChooseAllreduce(config_, bytes, shm_ != nullptr);
  if (algo != AllreduceAlgo::kShm) mpi_pages_.Collapse(buf, bytes);
  // Shared memory sums halves in float32 at no cost, so auto sends it the
  // small ones too, which MPI could only reduce as twice the bytes;
  // elsewhere HVDMX_HALF_PARTIALS=half keeps them in the dtype.
  const bool auto_shm = shm_ != nullptr && config_.allreduce_algo == AllreduceAlgo::kAuto;
  if (half && algo == AllreduceAlgo::kNative && auto_shm) algo = AllreduceAlgo::kShm;
  if (half && algo == AllreduceAlgo::kShm) {
    shm_->allreduce().Allreduce(buf, count, dtype, op, scale);
    return "SHM_ALLREDUCE";
  }
  if (half && config_.half_partials_wide) {
    return AllreduceWide(buf, count, dtype, op, scale, algo == AllreduceAlgo::kNative);
  }
  ScaleBuffer(buf, count, dtype, scale.pre);
  if (algo == AllreduceAlgo::kNative) {
    if (comm_.NativeAllreduce(buf, count, dtype, op)) {
      ScaleBuffer(buf, count, dtype, scale.post);
      return "MPI_ALLREDUCE";
    }
    // A comm without its own (TcpComm) sends small tensors to every rank
    // at once where shared memory does not take them.
    if (!auto_shm && ExchangeAllreduceFits(bytes, comm_.size())) {
      ExchangeAllreduce(comm_, buf, count, dtype, op, &exchange_scratch_);
      ScaleBuffer(buf, count, dtype, scale.post);
      return "EXCHANGE_ALLREDUCE";
    }
    // MPI has no float16/bfloat16 reductions: with HVDMX_HALF_PARTIALS=half
    // those take shared memory where auto would use it, else the ring.
    algo = auto_shm ? AllreduceAlgo::kShm : AllreduceAlgo::kRing;
  }
  if (algo == AllreduceAlgo::kShm) {
    shm_->allreduce().Allreduce(buf, count, dtype, op, Scale{1.0, scale.post});
    return "SHM_ALLREDUCE";
  }
  RingAllreduce(comm_, buf, count, dtype, op, config_.ring_segment_bytes, &ring_scratch_);
  ScaleBuffer(buf, count, dtype, scale.post);
  return "RING_ALLREDUCE";
}

const char* Executor::AllreduceWide(void* buf, int64_t count, DataType dtype, ReduceOp op,
                                    Scale scale, bool native) {
  const char* algorithm = comm_.size() == 1 ? "LOCAL_ALLREDUCE" : "RING_ALLREDUCE";
  const int64_t elem = static_cast<int64_t>(DataTypeSize(dtype));
  for (int64_t done = 0; done < count; done += kWidePieceElems) {
    const int64_t n = std::min(kWidePieceElems, count - done);
    char* piece = static_cast<char*>(buf) + done * elem;
    auto* wide = reinterpret_cast<float*>(wide_.Get(n * 4));
    if (comm_.size() > 1) mpi_pages_.Collapse(wide, n * 4);
    if (native && comm_.size() > 1) {
      WidenScaled(wide, piece, n, dtype, scale.pre);
      if (comm_.NativeAllreduce(wide, n, DataType::kFloat32, op)) {
        NarrowScaled(piece, wide, n, dtype, scale.post);
        algorithm = "MPI_ALLREDUCE";
      } else {  // a comm without MPI's (LocalComm): the ring, from the widened operands
        RingAllreduceWidened(comm_, piece, wide, /*operands_in_wide=*/true, n, dtype, op,
                             Scale{1.0, scale.post}, config_.ring_segment_bytes, &ring_scratch_);
      }
      continue;
    }
    RingAllreduceWidened(comm_, piece, wide, /*operands_in_wide=*/false, n, dtype, op, scale,
                         config_.ring_segment_bytes, &ring_scratch_);
  }
  return algorithm;
}

namespace {

using Clock = Timeline::Clock;

// Note [Timeline names]
// ~~~~~~~~~~~~~~~~~~~~~~
// A tensor's row on the timeline reads as Horovod's does, so that tools made
// for Horovod's timelines read ours: NEGOTIATE_<OP> while the ranks agree to
// run it, then <OP> (ALLREDUCE, BROADCAST, ALLGATHER, ALLTOALL,
// REDUCESCATTER, BARRIER, JOIN: Horovod's request and response type names;
// ERROR for a failed negotiation) until its last step has finished, with the
// steps nested inside it: QUEUE, MEMCPY_IN_FUSION_BUFFER, the transport
// (MPI_ALLREDUCE, MPI_BCAST, MPI_ALLTOALL as in Horovod; hvdmx's own
// RING_ALLREDUCE, SHM_ALLREDUCE, SHM_BCAST, ...), MEMCPY_OUT_FUSION_BUFFER.
// docs/timeline.md has the whole mapping.

// Horovod's names for a collective's operation and for its negotiation.
struct OperationNames {
  const char* operation;
  const char* negotiate;
};

OperationNames NamesOf(CollectiveType type) {
  switch (type) {
    case CollectiveType::kAllreduce: return {"ALLREDUCE", "NEGOTIATE_ALLREDUCE"};
    case CollectiveType::kBroadcast: return {"BROADCAST", "NEGOTIATE_BROADCAST"};
    case CollectiveType::kAllgather: return {"ALLGATHER", "NEGOTIATE_ALLGATHER"};
    case CollectiveType::kAlltoall: return {"ALLTOALL", "NEGOTIATE_ALLTOALL"};
    case CollectiveType::kReducescatter: return {"REDUCESCATTER", "NEGOTIATE_REDUCESCATTER"};
    case CollectiveType::kBarrier: return {"BARRIER", "NEGOTIATE_BARRIER"};
    case CollectiveType::kJoin: return {"JOIN", "NEGOTIATE_JOIN"};
  }
  return {"COLLECTIVE", "NEGOTIATE"};
}

// "dtype" and "shape" of a unit's tensors, for the timeline.
std::string TimelineArgs(const Request& request) {
  std::string dtypes, shapes;
  for (size_t t = 0; t < request.dtypes.size(); ++t) {
    dtypes += (t ? ", " : "") + DataTypeName(request.dtypes[t]);
    shapes += (t ? ", " : "") + ShapeString(request.shapes[t]);
  }
  return "\"dtype\": \"" + dtypes + "\", \"shape\": \"" + shapes + "\"";
}

// Fires the entry's callback and drops it, so that it fires once.
void Fire(TensorEntry& entry, const Status& status) {
  std::function<void(const Status&)> callback = std::move(entry.callback);
  entry.callback = nullptr;
  callback(status);
}

}  // namespace

void Executor::FinishReduced(const std::vector<ReducedUnit>& units, TensorQueue* queue) {
  Timeline& timeline = ProcessTimeline();
  for (const ReducedUnit& unit : units) {
    const Response& response = unit.response;
    TensorEntry entry;
    // Every rank that gave the unit's operands has its entry (a joined
    // rank sets no cache bits, so no unit completes without it).
    HVDMX_CHECK(queue->Take(response.name, &entry),
                "a unit reduced in the round that this rank has no entry for: " + response.name);
    const auto start = Clock::now();
    double post = response.scale.post;
    if (response.op == ReduceOp::kAverage) post /= comm_.size();
    RoundReduction::WriteOut(response, unit.reduced, post, entry.outputs);
    if (timeline.enabled()) {
      // As RunEntries records a unit: negotiation, the algorithm, the operation.
      const std::string args = TimelineArgs(entry.request);
      const auto end = Clock::now();
      timeline.Phase(response.name, NamesOf(response.type).negotiate, entry.enqueued, start, args);
      timeline.Phase(response.name, "ROUND_ALLREDUCE", start, end);
      timeline.Phase(response.name, NamesOf(response.type).operation, start, end, args);
    }
    Fire(entry, Status::Ok());
  }
}

void Executor::Run(const std::vector<Response>& responses, TensorQueue* queue) {
  std::vector<TensorEntry> entries(responses.size());
  try {
    RunEntries(responses, queue, entries);
  } catch (const PeerGone&) {
    // A peer stopped in the middle (Note [A peer that stops] in
    // shm_region.h), or its connection failed (comm/tcp_comm.h): what this
    // round took and has not finished is kept for the runtime, which
    // records why it stopped before it fails them with the rest, so that a
    // rank that reads a failed output finds the reason already there.
    for (TensorEntry& entry : entries) {
      if (entry.callback) unfinished_.push_back(std::move(entry));
    }
    throw;
  }
}

void Executor::RunEntries(const std::vector<Response>& responses, TensorQueue* queue,
                          std::vector<TensorEntry>& entries) {
  // Take every entry first: the groups below address them by response index.
  std::vector<int> remaining;
  // Zeros this rank contributes to allreduces it has joined through (see
  // Note [Join] in controller.h): it has no entry for them.
  std::vector<std::vector<char>> phantom_memory;
  Timeline& timeline = ProcessTimeline();
  const auto ready = Clock::now();
  std::vector<bool> started(responses.size(), false);
  if (timeline.enabled()) step_ends_.assign(responses.size(), ready);
  for (size_t r = 0; r < responses.size(); ++r) {
    const Response& response = responses[r];
    if (queue->Take(response.name, &entries[r])) {
      if (timeline.enabled()) {
        timeline.Phase(response.name, NamesOf(response.type).negotiate, entries[r].enqueued, ready,
                       TimelineArgs(entries[r].request));
      }
    } else {
      TensorEntry& phantom = entries[r];
      phantom.callback = [](const Status&) {};
      for (size_t t = 0; t < response.counts.size() && response.error.empty(); ++t) {
        HVDMX_CHECK(response.type == CollectiveType::kAllreduce, "phantom non-allreduce");
        phantom_memory.emplace_back(response.counts[t] * DataTypeSize(response.dtypes[t]), 0);
        phantom.inputs.push_back(phantom_memory.back().data());
        phantom.outputs.push_back(phantom_memory.back().data());
      }
    }
    remaining.push_back(static_cast<int>(response.counts.size()));
  }
  for (const FusionGroup& group :
       PlanFusion(responses, config_.fusion_threshold, config_.fusion_max_tensor_bytes)) {
    const int first = group.items[0].response;
    const Response& response = responses[first];
    TensorEntry& entry = entries[first];
    if (timeline.enabled()) {
      const auto now = Clock::now();
      for (const FusionGroup::Item& item : group.items) {
        if (!started[item.response])
          timeline.Phase(responses[item.response].name, "QUEUE", ready, now);
        started[item.response] = true;
        if (item.response < static_cast<int>(step_ends_.size())) step_ends_[item.response] = now;
      }
      // A failed negotiation (alone in its group) ends here, before its
      // callback lets the caller go on (RecordOperations comes later).
      if (!response.error.empty()) timeline.Phase(response.name, "ERROR", ready, now);
    }
    if (!response.error.empty()) {
      Fire(entry, Status::Mismatch(response.error));
      continue;
    }
    if (response.type != CollectiveType::kAllreduce) {
      const auto start = Clock::now();
      const char* algorithm = RunUnit(response, entry);
      // Barrier and join have no step of their own: their operation says it all.
      if (timeline.enabled() && !response.sizes_only &&
          std::strcmp(algorithm, NamesOf(response.type).operation) != 0) {
        const auto end = Clock::now();
        timeline.Phase(response.name, algorithm, start, end, TimelineArgs(entry.request));
        if (first < static_cast<int>(step_ends_.size())) step_ends_[first] = end;
      }
      if (entry.on_response) entry.on_response(response);
      Fire(entry, Status::Ok());
      continue;
    }
    RunAllreduceGroup(group, responses, entries);
    for (const FusionGroup::Item& item : group.items) {
      if (--remaining[item.response] == 0) Fire(entries[item.response], Status::Ok());
    }
  }
  // Allreduces with no tensors at all (an empty grouped call) are in no
  // group; they are done at once.
  for (size_t r = 0; r < responses.size(); ++r) {
    if (responses[r].counts.empty() && responses[r].error.empty() &&
        responses[r].type == CollectiveType::kAllreduce) {
      Fire(entries[r], Status::Ok());
    }
  }

  if (timeline.enabled()) RecordOperations(responses, entries, ready);
}

void Executor::RecordOperations(const std::vector<Response>& responses,
                                const std::vector<TensorEntry>& entries, Clock::time_point ready) {
  Timeline& timeline = ProcessTimeline();
  if (step_ends_.size() != responses.size()) return;  // the timeline started during the round
  for (size_t r = 0; r < responses.size(); ++r) {
    const Response& response = responses[r];
    if (!response.error.empty()) continue;  // recorded as ERROR when it failed
    // A rank that has joined reduces zeros under the name: it has no request.
    const Request& request = entries[r].request;
    timeline.Phase(response.name, NamesOf(response.type).operation, ready, step_ends_[r],
                   request.name.empty() ? std::string() : TimelineArgs(request));
  }
}

const char* Executor::RunUnit(const Response& response, TensorEntry& entry) {
  // A sizes round has delivered its result in the response itself; barrier
  // and join are complete once negotiated.
  if (response.sizes_only) return "SIZES";
  switch (response.type) {
    case CollectiveType::kBroadcast: return RunBroadcast(response, entry);
    case CollectiveType::kAllgather: return RunAllgather(response, entry);
    case CollectiveType::kAlltoall: return RunAlltoall(response, entry);
    case CollectiveType::kReducescatter: return RunReducescatter(response, entry);
    case CollectiveType::kBarrier: return "BARRIER";
    case CollectiveType::kJoin: return "JOIN";
    case CollectiveType::kAllreduce: break;
  }
  return "COLLECTIVE";
}

int64_t Executor::PieceBytes() const {
  return std::max(config_.fusion_piece_bytes, comm_.size() * config_.ring_segment_bytes);
}

bool Executor::ShmReduces(int64_t bytes) const {
  return comm_.size() > 1 &&
         ChooseAllreduce(config_, bytes, shm_ != nullptr) == AllreduceAlgo::kShm;
}

bool Executor::ShmMoves(CollectiveType type, int64_t bytes) const {
  if (shm_ == nullptr || shm_->hierarchical() || shm_->size() != comm_.size()) return false;
  // See "Broadcast, allgather and alltoall on one host" in docs/algorithms.md.
  if (config_.allreduce_algo == AllreduceAlgo::kShm) return true;
  if (config_.allreduce_algo != AllreduceAlgo::kAuto) return false;
  if (type == CollectiveType::kBroadcast) return bytes >= config_.shm_min_bytes;
  if (type == CollectiveType::kAlltoall || type == CollectiveType::kReducescatter) return true;
  // Through the stages (two copies), large allgathers lose to MPI's
  // single-copy point-to-point; read directly, they do not.
  return type == CollectiveType::kAllgather &&
         (shm_->exchange().direct_min_bytes() >= 0 || bytes <= kShmAllgatherMaxBytes);
}

void Executor::RunAllreduceGroup(const FusionGroup& group, const std::vector<Response>& responses,
                                 std::vector<TensorEntry>& entries) {
  const Response& head = responses[group.items[0].response];
  const DataType dtype = head.dtypes[group.items[0].tensor];
  const int64_t elem = static_cast<int64_t>(DataTypeSize(dtype));
  Scale scale = head.scale;
  if (head.op == ReduceOp::kAverage) scale.post /= comm_.size();

  Timeline& timeline = ProcessTimeline();
  // Records `phase` from `start` to `end` on every unit of the group.
  auto record = [&](const char* phase, Clock::time_point start, Clock::time_point end) {
    if (!timeline.enabled()) return;
    int last = -1;
    for (const FusionGroup::Item& item : group.items) {
      if (item.response == last) continue;
      last = item.response;
      timeline.Phase(responses[item.response].name, phase, start, end);
      if (item.response < static_cast<int>(step_ends_.size())) {
        step_ends_[item.response] = std::max(step_ends_[item.response], end);
      }
    }
  };
  auto t0 = Clock::now();
  if (head.op == ReduceOp::kAdasum) {
    const char* algorithm = RunAdasumGroup(group, responses, entries);
    record(algorithm, t0, Clock::now());
    return;
  }

  const bool shm = ShmReduces(group.bytes);
  const bool half = HalfReducesWide(dtype);  // scaled inside the reduction
  if (group.items.size() == 1 || shm) {
    // Each tensor is reduced where it lies, in its output: one tensor needs
    // no fusion buffer, and shared memory reads and writes a fused group's
    // tensors in place (see ShmAllreduce::Span). Out of place, shared
    // memory reads the input where it is unless a prescale must write it;
    // the others reduce a copy of it in the output.
    spans_.clear();
    bool copied = false;
    for (const FusionGroup::Item& item : group.items) {
      TensorEntry& entry = entries[item.response];
      const int64_t count = responses[item.response].counts[item.tensor];
      void* out = entry.outputs[item.tensor];
      const void* in = entry.inputs[item.tensor];
      if (out == in) {
        spans_.push_back({out, count});
      } else if (shm && (scale.pre == 1.0 || half)) {
        spans_.push_back({out, count, in});
      } else {
        if (count > 0) std::memcpy(out, in, count * elem);
        copied = true;
        spans_.push_back({out, count});
      }
    }
    if (copied) {
      const auto now = Clock::now();
      record("MEMCPY_IN_OUTPUT", t0, now);
      t0 = now;
    }
    const char* algorithm = "SHM_ALLREDUCE";
    if (shm) {
      if (!half) {
        for (const ShmAllreduce::Span& span : spans_) {
          ScaleBuffer(span.data, span.count, dtype, scale.pre);
        }
      }
      shm_->allreduce().Allreduce(spans_, dtype, head.op, half ? scale : Scale{1.0, scale.post});
    } else {
      algorithm = Allreduce(spans_[0].data, spans_[0].count, dtype, head.op, scale);
    }
    record(algorithm, t0, Clock::now());
    return;
  }

  // The group goes through the fusion buffer in pieces (PieceBytes). Piece
  // boundaries fall on elements.
  const int64_t piece_limit = std::max(elem, PieceBytes() / elem * elem);
  char* buffer = fusion_.Get(std::min(group.bytes, piece_limit));
  struct Cursor {
    size_t item = 0;     // the group's item where a piece starts
    int64_t within = 0;  // and the byte of that tensor
  };
  // Calls f(item, byte in its tensor, byte in the piece, bytes) for each
  // tensor's share of the `piece` bytes from `at`; returns the cursor after.
  auto walk = [&](Cursor at, int64_t piece, auto&& f) {
    for (int64_t in_piece = 0; in_piece < piece;) {
      const FusionGroup::Item& item = group.items[at.item];
      const int64_t bytes = responses[item.response].counts[item.tensor] * elem;
      const int64_t take = std::min(bytes - at.within, piece - in_piece);
      if (take > 0) f(item, at.within, in_piece, take);
      in_piece += take;
      at.within += take;
      if (at.within == bytes) at = Cursor{at.item + 1, 0};
    }
    return at;
  };
  const char* algorithm = "LOCAL_ALLREDUCE";  // what Allreduce calls an empty group
  Clock::duration copy_in{}, reduce{}, copy_out{};
  Cursor start;
  for (int64_t done = 0; done < group.bytes;) {
    const int64_t piece = std::min(piece_limit, group.bytes - done);
    auto t = Clock::now();
    const Cursor next = walk(
        start, piece, [&](const FusionGroup::Item& item, int64_t at, int64_t to, int64_t bytes) {
          const char* in = static_cast<const char*>(entries[item.response].inputs[item.tensor]);
          std::memcpy(buffer + to, in + at, bytes);
        });
    auto now = Clock::now();
    copy_in += now - t;
    t = now;
    const int64_t count = piece / elem;
    algorithm = Allreduce(buffer, count, dtype, head.op, scale);
    now = Clock::now();
    reduce += now - t;
    t = now;
    walk(start, piece, [&](const FusionGroup::Item& item, int64_t at, int64_t from, int64_t bytes) {
      char* out = static_cast<char*>(entries[item.response].outputs[item.tensor]);
      std::memcpy(out + at, buffer + from, bytes);
    });
    copy_out += Clock::now() - t;
    start = next;
    done += piece;
  }
  // The pieces interleave the three phases; the timeline shows each
  // phase's total, one after the other from the group's start.
  const auto reduce_start = t0 + copy_in;
  const auto out_start = reduce_start + reduce;
  record("MEMCPY_IN_FUSION_BUFFER", t0, reduce_start);
  record(algorithm, reduce_start, out_start);
  record("MEMCPY_OUT_FUSION_BUFFER", out_start, out_start + copy_out);
}

const char* Executor::RunAdasumGroup(const FusionGroup& group,
                                     const std::vector<Response>& responses,
                                     std::vector<TensorEntry>& entries) {
  const Response& head = responses[group.items[0].response];
  const DataType dtype = head.dtypes[group.items[0].tensor];
  const int64_t elem = static_cast<int64_t>(DataTypeSize(dtype));
  adasum_counts_.clear();
  for (const FusionGroup::Item& item : group.items) {
    adasum_counts_.push_back(responses[item.response].counts[item.tensor]);
  }
  // A fused group fits the fusion buffer whole (its bytes are at most the
  // fusion threshold): Adasum halves the whole group, so it cannot go in
  // pieces as the other ops do.
  const bool alone = group.items.size() == 1;
  char* buffer = nullptr;
  if (alone) {
    TensorEntry& entry = entries[group.items[0].response];
    buffer = static_cast<char*>(entry.outputs[group.items[0].tensor]);
    const void* in = entry.inputs[group.items[0].tensor];
    if (buffer != in && group.bytes > 0) std::memcpy(buffer, in, group.bytes);
  } else {
    buffer = fusion_.Get(group.bytes);
    int64_t at = 0;
    for (const FusionGroup::Item& item : group.items) {
      const int64_t bytes = responses[item.response].counts[item.tensor] * elem;
      if (bytes > 0) std::memcpy(buffer + at, entries[item.response].inputs[item.tensor], bytes);
      at += bytes;
    }
  }
  const int64_t count = group.bytes / elem;
  ScaleBuffer(buffer, count, dtype, head.scale.pre);
  const char* algorithm = "ADASUM_ALLREDUCE";
  if (config_.adasum_hierarchical && comm_.size() > 1) {
    HierarchicalAdasumAllreduce(comm_, hosts_, buffer, adasum_counts_, dtype, &adasum_scratch_);
    algorithm = "HIERARCHICAL_ADASUM";
  } else {
    AdasumAllreduce(comm_, {}, buffer, adasum_counts_, dtype, &adasum_scratch_);
  }
  ScaleBuffer(buffer, count, dtype, head.scale.post);
  if (!alone) {
    int64_t at = 0;
    for (const FusionGroup::Item& item : group.items) {
      const int64_t bytes = responses[item.response].counts[item.tensor] * elem;
      if (bytes > 0) std::memcpy(entries[item.response].outputs[item.tensor], buffer + at, bytes);
      at += bytes;
    }
  }
  return comm_.size() == 1 ? "LOCAL_ALLREDUCE" : algorithm;
}

}  // namespace hvdmx
