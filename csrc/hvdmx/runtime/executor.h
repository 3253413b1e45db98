// Runs one round's responses on this rank: for each fusion group, pack the
// inputs into the fusion buffer (unless the group is one tensor, or goes
// through shared memory, which reads the tensors where they are), run the
// collective, unpack and scale, and fire each entry's callback as soon as
// all of its tensors are done. The other collectives run one unit at a
// time, several tensors of a grouped call packed into one exchange
// (executor_units.cc).
//
// Threading: the runtime's background thread only.
#ifndef HVDMX_EXECUTOR_H_
#define HVDMX_EXECUTOR_H_

#include <utility>
#include <vector>

#include "algorithms/adasum.h"
#include "algorithms/bruck.h"
#include "algorithms/ring.h"
#include "base/timeline.h"
#include "comm/comm.h"
#include "comm/host_map.h"
#include "config/env_config.h"
#include "negotiation/message.h"
#include "negotiation/round_reduction.h"
#include "negotiation/tensor_queue.h"
#include "platform/huge_pages.h"
#include "runtime/autotune.h"
#include "runtime/fusion_buffer.h"
#include "runtime/fusion_plan.h"
#include "shm/shm_host.h"

namespace hvdmx {

class Executor {
 public:
  // `shm`, when given, is the shared-memory allreduce over the same ranks as
  // `comm` (all on one host); it must outlive the executor. `peers_on_host`:
  // another rank of `comm` runs on this host, so MPI may copy this rank's
  // buffers with cross-memory attach (see mpi_pages_). `hosts`: which ranks
  // of `comm` share a host, as the hierarchical Adasum groups them (the
  // job's, found once at init: job/host_split.h).
  Executor(DataComm& comm, const Config& config, ShmHost* shm = nullptr, bool peers_on_host = false,
           HostMap hosts = HostMap())
      : comm_(comm),
        config_(config),
        mpi_pages_(config.huge_pages && peers_on_host),
        shm_(shm),
        hosts_(std::move(hosts)) {}

  // Autotune's setting for the rounds from the one being run on: the
  // fusion threshold and the allreduce algorithm (the cycle time is the
  // runtime's). Every rank applies the same setting to the same round.
  void Apply(const TunedSetting& setting) {
    config_.fusion_threshold = setting.fusion_threshold;
    config_.allreduce_algo = setting.algo;
  }

  // Writes the outputs of the allreduces the round completed (Note [Small
  // tensors in the round] in negotiation/round_reduction.h) and fires their
  // callbacks.
  void FinishReduced(const std::vector<ReducedUnit>& units, TensorQueue* queue);

  // Throws PeerGone when a peer stops in the middle (Note [A peer that
  // stops]), keeping the round's entries that had not completed for
  // TakeUnfinished.
  void Run(const std::vector<Response>& responses, TensorQueue* queue);

  // The entries a Run that threw had taken and not completed, their
  // callbacks not fired: the runtime fails them once its stop status is set.
  std::vector<TensorEntry> TakeUnfinished() { return std::exchange(unfinished_, {}); }

  // In-place allreduce of one buffer with the configured algorithm, each
  // rank's operand multiplied by `scale.pre` first, in the dtype, and the
  // result by `scale.post` (float16 and bfloat16 summed and postscaled in
  // float32, rounded once: Note [Half precision summed in float32]);
  // returns the algorithm's name for the timeline.
  const char* Allreduce(void* buf, int64_t count, DataType dtype, ReduceOp op, Scale scale);

  int64_t fusion_buffer_bytes() const { return fusion_.capacity(); }
  const HugePageCollapser& mpi_pages() const { return mpi_pages_; }

 private:
  // Run's work, on the round's entries (each callback fired once, and
  // then cleared).
  void RunEntries(const std::vector<Response>& responses, TensorQueue* queue,
                  std::vector<TensorEntry>& entries);
  void RunAllreduceGroup(const FusionGroup& group, const std::vector<Response>& responses,
                         std::vector<TensorEntry>& entries);
  // An Adasum group (algorithms/adasum.h): the tensors side by side in the
  // fusion buffer (a lone one in its output), each rank's scaled by the
  // prescale, combined tensor by tensor, then postscaled. Returns the
  // algorithm's name for the timeline.
  const char* RunAdasumGroup(const FusionGroup& group, const std::vector<Response>& responses,
                             std::vector<TensorEntry>& entries);
  // Writes each response's operation to the timeline (Note [Timeline
  // names] in executor.cc), from `ready` to the end of its last step.
  void RecordOperations(const std::vector<Response>& responses,
                        const std::vector<TensorEntry>& entries, Timeline::Clock::time_point ready);
  // Runs a unit that is not an allreduce (its own fusion group); returns
  // the algorithm's name for the timeline. Broadcast, allgather and
  // alltoall move their bytes through shared memory when ShmMoves says so.
  const char* RunUnit(const Response& response, TensorEntry& entry);
  const char* RunBroadcast(const Response& response, TensorEntry& entry);
  const char* RunAllgather(const Response& response, TensorEntry& entry);
  const char* RunAlltoall(const Response& response, TensorEntry& entry);
  // A float16 or bfloat16 allreduce of `buf` with float32 partials, through
  // the wide buffer in pieces of at most kWidePieceElems: on the ring, or,
  // with `native`, the comm's own float32 allreduce where it has one (MPI's).
  // Returns the algorithm's name for the timeline.
  const char* AllreduceWide(void* buf, int64_t count, DataType dtype, ReduceOp op, Scale scale,
                            bool native);
  static constexpr int64_t kWidePieceElems = int64_t{8} << 20;
  // Returns the algorithm's name for the timeline.
  const char* RunReducescatter(const Response& response, TensorEntry& entry);
  // Whether a unit of `type` moving `bytes` in all takes shared memory:
  // every rank is on this host and HVDMX_ALLREDUCE_ALGO is shm, or auto for
  // a broadcast of at least HVDMX_SHM_MIN_BYTES, any alltoall or
  // reducescatter, and an allgather of at most kShmAllgatherMaxBytes unless
  // the large blocks are read from the peers' buffers directly, which takes
  // any size (measured: see docs/algorithms.md). The same answer on every
  // rank. (RunAllgather also sends a lone tensor of any size there when the
  // ranks write into each other's outputs.)
  bool ShmMoves(CollectiveType type, int64_t bytes) const;
  static constexpr int64_t kShmAllgatherMaxBytes = int64_t{32} << 20;
  std::vector<TensorEntry> unfinished_;  // see TakeUnfinished
  // Whether an allreduce of `bytes` in all takes shared memory (then a
  // fused group needs no fusion buffer).
  bool ShmReduces(int64_t bytes) const;

  // The most bytes that go through the fusion buffer at a time on the ring
  // or MPI: HVDMX_FUSION_PIECE_BYTES, so that each piece is copied in,
  // reduced and copied out while it is still in cache and the transport
  // only sees messages of the size it was measured to like ("Fusion" in
  // docs/algorithms.md); but at least one ring segment per rank, so that in
  // a large job pieces do not shrink the ring's per-step messages below a
  // segment.
  int64_t PieceBytes() const;

  DataComm& comm_;
  Config config_;  // the runtime's, with autotune's setting (Apply)
  // Collapses the buffers this rank hands to MPI to move (Note [Huge pages
  // under what peers read]): on one host MPICH copies large messages
  // straight from the sender's memory, pinning its pages as it goes. Off
  // unless a peer shares the host and HVDMX_HUGE_PAGES is 1.
  HugePageCollapser mpi_pages_;
  FusionBuffer fusion_;
  FusionBuffer wide_;                   // a half dtype's float32 operands on the ring and MPI
  std::vector<char> exchange_scratch_;  // ExchangeAllreduce
  RingScratch ring_scratch_;
  AdasumScratch adasum_scratch_;
  std::vector<int64_t> adasum_counts_;     // an Adasum group's tensors, reused
  std::vector<int64_t> starts_;            // chunk boundaries, reused
  std::vector<int64_t> tensor_starts_;     // one tensor's blocks (allgather unpacking:
                                           // bytes each packed tensor has), reused
  std::vector<size_t> packed_;             // allgather: tensors packed together, reused
  std::vector<int64_t> piece_starts_;      // reducescatter on the ring: one piece's
                                           // chunk boundaries, reused
  std::vector<int64_t> pair_bytes_;        // alltoall: bytes i sends to j, reused
  AlltoallScratch alltoall_scratch_;       // alltoall by Bruck's algorithm
  std::vector<ShmAllreduce::Span> spans_;  // a group's tensors reduced in place, reused
  // Timeline only: when each response of the round running finished its last
  // step (QUEUE, the copies, the collective), reused.
  std::vector<Timeline::Clock::time_point> step_ends_;
  ShmHost* shm_;   // null unless ranks share hosts (see job/shm_wiring.h)
  HostMap hosts_;  // which ranks of comm_ share a host
};

}  // namespace hvdmx

#endif  // HVDMX_EXECUTOR_H_
