// Which tensors of a round run together (policy only; fusion_buffer.h owns
// the memory).
//
// Allreduce tensors that are next to each other in the round's order and
// share dtype, op and scale factors are packed into one fused group of at
// most `threshold` bytes. A tensor larger than the threshold, or than
// `max_tensor_bytes`, runs alone: in place, with no copy through the buffer.
// Every other response (an error response, and every collective but
// allreduce: broadcast, allgather, alltoall, reducescatter, barrier, join)
// is a group of its own: one item with tensor -1 (the whole response),
// which the executor runs as one unit (RunUnit). Every rank plans from the
// same response list, so every rank runs the same groups.
#ifndef HVDMX_FUSION_PLAN_H_
#define HVDMX_FUSION_PLAN_H_

#include <cstdint>
#include <vector>

#include "negotiation/message.h"

namespace hvdmx {

struct FusionGroup {
  struct Item {
    int response;  // index into the round's responses
    int tensor;    // index into that response's tensors
  };
  std::vector<Item> items;
  int64_t bytes = 0;
};

std::vector<FusionGroup> PlanFusion(const std::vector<Response>& responses, int64_t threshold,
                                    int64_t max_tensor_bytes);

}  // namespace hvdmx

#endif  // HVDMX_FUSION_PLAN_H_
