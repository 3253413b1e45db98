#include "negotiation/response_cache.h"

namespace hvdmx {

int64_t ResponseCache::Lookup(const Request& request) const {
  auto it = by_name_.find(request.name);
  if (it == by_name_.end()) return -1;
  return slots_[it->second].request.SameParams(request) ? it->second : -1;
}

void ResponseCache::Touch(int64_t slot) { lru_.splice(lru_.begin(), lru_, slots_[slot].lru_pos); }

void ResponseCache::Put(const Request& request, const Response& response) {
  if (capacity_ == 0) return;
  int64_t slot;
  auto it = by_name_.find(request.name);
  if (it != by_name_.end()) {
    slot = it->second;
  } else if (static_cast<int64_t>(slots_.size()) < capacity_) {
    slot = static_cast<int64_t>(slots_.size());
    slots_.push_back(Slot{});
    lru_.push_front(slot);
    slots_[slot].lru_pos = lru_.begin();
    by_name_[request.name] = slot;
  } else {
    slot = lru_.back();
    by_name_.erase(slots_[slot].request.name);
    by_name_[request.name] = slot;
  }
  slots_[slot].request = request;
  slots_[slot].response = response;
  Touch(slot);
}

}  // namespace hvdmx
