#include "tensor_queue.h"

namespace hvdmx {

Status TensorQueue::Add(TensorEntry entry) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string name = entry.request.name;
  if (entries_.count(name)) {
    return Status::InvalidArgument("a collective named '" + name +
                                   "' is still pending on this rank; wait for it to finish "
                                   "or give the new one another name");
  }
  new_requests_.push_back(entry.request);
  entries_.emplace(name, std::move(entry));
  return Status::Ok();
}

std::vector<Request> TensorQueue::TakeNewRequests() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Request> out;
  out.swap(new_requests_);
  return out;
}

bool TensorQueue::HasNew() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !new_requests_.empty();
}

bool TensorQueue::Take(const std::string& name, TensorEntry* out) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(name);
  if (it == entries_.end()) return false;
  *out = std::move(it->second);
  entries_.erase(it);
  return true;
}

std::vector<std::string> TensorQueue::EnqueuedBefore(std::chrono::steady_clock::time_point cutoff,
                                                     size_t limit, size_t* total) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> names;
  *total = 0;
  for (const auto& kv : entries_) {
    // A joined rank waits for the others by design; that is no stall.
    if (kv.second.enqueued >= cutoff || kv.second.request.type == CollectiveType::kJoin) continue;
    ++*total;
    if (names.size() < limit) names.push_back(kv.first);
  }
  return names;
}

std::vector<TensorEntry> TensorQueue::TakeAll() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<TensorEntry> out;
  for (auto& kv : entries_) out.push_back(std::move(kv.second));
  entries_.clear();
  new_requests_.clear();
  return out;
}

}  // namespace hvdmx
