// Entries submitted on this rank and not yet completed, by name.
//
// Add is called from MXNet engine threads; everything else from the
// runtime's background thread. One mutex guards it all.
#ifndef HVDMX_TENSOR_QUEUE_H_
#define HVDMX_TENSOR_QUEUE_H_

#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "common.h"
#include "message.h"

namespace hvdmx {

// One negotiation unit on this rank: its request, the data pointers of each
// tensor (input and output may be the same), and the callback to fire once.
struct TensorEntry {
  Request request;
  std::vector<const void*> inputs;
  std::vector<void*> outputs;
  std::function<void(const Status&)> callback;
  // Optional: called with the response just before a successful callback,
  // for calls that need what the negotiation decided (sizes, join's rank).
  std::function<void(const Response&)> on_response;
  std::chrono::steady_clock::time_point enqueued = std::chrono::steady_clock::now();
};

class TensorQueue {
 public:
  // Fails, leaving the entry's callback unfired, if the name is pending.
  Status Add(TensorEntry entry);
  // The requests added since the last call, in the order they were added.
  std::vector<Request> TakeNewRequests();
  bool HasNew() const;
  // Removes the entry into *out; false if there is none by that name (a unit
  // this rank joined through, see Note [Join] in controller.h).
  bool Take(const std::string& name, TensorEntry* out);
  // Names of entries enqueued before `cutoff`, at most `limit` of them, and
  // how many there are in all.
  std::vector<std::string> EnqueuedBefore(std::chrono::steady_clock::time_point cutoff,
                                          size_t limit, size_t* total) const;
  // Removes every entry and returns them (to be failed by the caller).
  std::vector<TensorEntry> TakeAll();

 private:
  mutable std::mutex mu_;
  std::unordered_map<std::string, TensorEntry> entries_;
  std::vector<Request> new_requests_;
};

}  // namespace hvdmx

#endif  // HVDMX_TENSOR_QUEUE_H_
