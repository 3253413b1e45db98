// Runs one round's responses on this rank: for each fusion group, pack the
// inputs into the fusion buffer, run the collective, unpack and scale, and
// fire each entry's callback as soon as all of its tensors are done. The
// other collectives run one unit at a time, several tensors of a grouped
// call packed into one exchange.
//
// Threading: the runtime's background thread only.
#ifndef HVDMX_EXECUTOR_H_
#define HVDMX_EXECUTOR_H_

#include <vector>

#include "comm.h"
#include "env_config.h"
#include "fusion_buffer.h"
#include "fusion_plan.h"
#include "message.h"
#include "ring.h"
#include "shm_allreduce.h"
#include "tensor_queue.h"

namespace hvdmx {

class Executor {
 public:
  // `shm`, when given, is the shared-memory allreduce over the same ranks as
  // `comm` (all on one host); it must outlive the executor.
  Executor(Comm& comm, const Config& config, ShmAllreduce* shm = nullptr)
      : comm_(comm), config_(config), shm_(shm) {}

  void Run(const std::vector<Response>& responses, TensorQueue* queue);

  // In-place allreduce of one buffer with the configured algorithm; returns
  // the algorithm's name for the timeline.
  const char* Allreduce(void* buf, int64_t count, DataType dtype, ReduceOp op);

 private:
  void RunAllreduceGroup(const FusionGroup& group, const std::vector<Response>& responses,
                         std::vector<TensorEntry>& entries);
  // Runs a unit that is not an allreduce (its own fusion group).
  void RunUnit(const Response& response, TensorEntry& entry);
  void RunBroadcast(const Response& response, TensorEntry& entry);
  void RunAllgather(const Response& response, TensorEntry& entry);
  void RunAlltoall(const Response& response, TensorEntry& entry);
  void RunReducescatter(const Response& response, TensorEntry& entry);

  Comm& comm_;
  const Config& config_;
  FusionBuffer fusion_;
  RingScratch ring_scratch_;
  std::vector<int64_t> starts_;             // chunk boundaries, reused
  std::vector<Comm::Request> requests_;     // outstanding point-to-point, reused
  ShmAllreduce* shm_;  // null unless every rank is on this host
};

}  // namespace hvdmx

#endif  // HVDMX_EXECUTOR_H_
