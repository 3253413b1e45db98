#include "negotiation/tensor_queue.h"

#include <utility>

namespace hvdmx {

uint64_t TensorQueue::Reserve(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  return turns_[name].reserved++;
}

void TensorQueue::Cancel(const std::string& name, uint64_t turn) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = turns_.find(name);
  if (it == turns_.end()) return;  // TakeAll has cleared it
  it->second.cancelled.insert(turn);
  AdvanceLocked(name);
}

Status TensorQueue::Add(TensorEntry entry, bool* deferred) {
  std::lock_guard<std::mutex> lock(mu_);
  if (deferred != nullptr) *deferred = false;
  const std::string& name = entry.request.name;
  if (entry.turn == TensorEntry::kNoTurn) {
    if (entries_.count(name)) {
      return Status::InvalidArgument("a collective named '" + name +
                                     "' is still pending on this rank; wait for it to finish "
                                     "or give the new one another name");
    }
    AdmitLocked(std::move(entry));
    return Status::Ok();
  }
  auto it = turns_.find(name);
  if (it == turns_.end()) {
    // TakeAll has cleared the turns: the runtime has stopped, and the
    // caller fails the entry.
    return Status::Shutdown("hvdmx has stopped");
  }
  if (entry.turn == it->second.current && entries_.count(name) == 0) {
    AdmitLocked(std::move(entry));
    return Status::Ok();
  }
  if (deferred != nullptr) *deferred = true;
  const uint64_t turn = entry.turn;
  it->second.waiting.emplace(turn, std::move(entry));
  return Status::Ok();
}

void TensorQueue::AdmitLocked(TensorEntry entry) {
  const std::string name = entry.request.name;
  new_requests_.push_back(entry.request);
  entries_.emplace(name, std::move(entry));
}

void TensorQueue::AdvanceLocked(const std::string& name) {
  auto it = turns_.find(name);
  if (it == turns_.end()) return;
  Turns& turns = it->second;
  while (turns.cancelled.erase(turns.current) > 0) ++turns.current;
  if (entries_.count(name) == 0) {
    auto next = turns.waiting.find(turns.current);
    if (next != turns.waiting.end()) {
      TensorEntry entry = std::move(next->second);
      turns.waiting.erase(next);
      // Its wait behind the turn before is no stall of its own.
      entry.enqueued = std::chrono::steady_clock::now();
      ++released_;
      AdmitLocked(std::move(entry));
      return;
    }
  }
  if (turns.current == turns.reserved && turns.waiting.empty()) turns_.erase(it);
}

int64_t TensorQueue::TakeReleasedCount() {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t n = released_;
  released_ = 0;
  return n;
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
  auto turns = turns_.find(name);
  if (turns != turns_.end()) {
    if (out->turn != TensorEntry::kNoTurn && turns->second.current == out->turn) {
      ++turns->second.current;
    }
    AdvanceLocked(name);
  }
  return true;
}

bool TensorQueue::Inputs(const std::string& name, std::vector<const void*>* out) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(name);
  if (it == entries_.end()) return false;
  *out = it->second.inputs;
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
  for (auto& kv : turns_) {
    for (auto& waiting : kv.second.waiting) {
      out.push_back(std::move(waiting.second));
      ++released_;
    }
  }
  entries_.clear();
  new_requests_.clear();
  turns_.clear();
  return out;
}

}  // namespace hvdmx
