// The LRU of responses that repeat, and their bit positions.
//
// Every rank holds an identical cache: it changes only through Put and
// Touch, which every rank calls in the same order (see Note [Negotiation
// round] in controller.h). A slot index is the tensor's bit position in the
// round's bit vector. Knows nothing of the queue or the communicator.
#ifndef HVDMX_RESPONSE_CACHE_H_
#define HVDMX_RESPONSE_CACHE_H_

#include <cstdint>
#include <list>
#include <string>
#include <unordered_map>
#include <vector>

#include "negotiation/message.h"

namespace hvdmx {

class ResponseCache {
 public:
  explicit ResponseCache(int64_t capacity) : capacity_(capacity) {}

  int64_t capacity() const { return capacity_; }
  int64_t size() const { return static_cast<int64_t>(by_name_.size()); }
  // Slots 0 .. slots() - 1 hold a response.
  int64_t slots() const { return static_cast<int64_t>(slots_.size()); }
  // The slot holding a response for a request with the same parameters, or -1.
  int64_t Lookup(const Request& request) const;
  const Request& request(int64_t slot) const { return slots_[slot].request; }
  const Response& response(int64_t slot) const { return slots_[slot].response; }
  // Makes `slot` the most recently used.
  void Touch(int64_t slot);
  // Adds `response` (replacing an entry of the same name); when full, the
  // least recently used entry gives up its slot. No-op at capacity 0.
  void Put(const Request& request, const Response& response);

 private:
  struct Slot {
    Request request;
    Response response;
    std::list<int64_t>::iterator lru_pos;
  };
  int64_t capacity_;
  std::vector<Slot> slots_;
  std::unordered_map<std::string, int64_t> by_name_;
  std::list<int64_t> lru_;  // front: most recently used
};

}  // namespace hvdmx

#endif  // HVDMX_RESPONSE_CACHE_H_
