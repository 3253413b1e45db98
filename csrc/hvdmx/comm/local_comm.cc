#include "comm/local_comm.h"

#include <cstring>

namespace hvdmx {

void LocalWorld::Post(int src, int dst, std::string message) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    boxes_[src * size_ + dst].push_back(std::move(message));
  }
  cv_.notify_all();
}

std::string LocalWorld::Take(int src, int dst) {
  std::unique_lock<std::mutex> lock(mu_);
  auto& box = boxes_[src * size_ + dst];
  cv_.wait(lock, [&] { return !box.empty(); });
  std::string message = std::move(box.front());
  box.pop_front();
  return message;
}

bool LocalWorld::TryTake(int src, int dst, std::string* out) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& box = boxes_[src * size_ + dst];
  if (box.empty()) return false;
  *out = std::move(box.front());
  box.pop_front();
  return true;
}

Comm::Request LocalComm::ISend(const void* buf, int64_t bytes, int peer) {
  world_->Post(rank_, peer, std::string(static_cast<const char*>(buf), bytes));
  return next_request_++;
}

Comm::Request LocalComm::IRecv(void* buf, int64_t bytes, int peer) {
  Request id = next_request_++;
  recvs_[id] = PendingRecv{buf, bytes, peer};
  return id;
}

void LocalComm::Wait(Request request) {
  auto it = recvs_.find(request);
  if (it == recvs_.end()) return;  // a send: complete at once
  std::string message = world_->Take(it->second.peer, rank_);
  HVDMX_CHECK(static_cast<int64_t>(message.size()) == it->second.bytes,
              "LocalComm message size mismatch");
  if (!message.empty()) std::memcpy(it->second.buf, message.data(), message.size());
  recvs_.erase(it);
}

void LocalComm::Bcast(void* buf, int64_t bytes, int root) {
  if (rank_ == root) {
    for (int peer = 0; peer < size(); ++peer) {
      if (peer != root) world_->Post(rank_, peer, std::string(static_cast<char*>(buf), bytes));
    }
    return;
  }
  std::string message = world_->Take(root, rank_);
  HVDMX_CHECK(static_cast<int64_t>(message.size()) == bytes, "LocalComm bcast size mismatch");
  if (bytes) std::memcpy(buf, message.data(), bytes);
}

std::vector<std::string> LocalComm::Gather(const std::string& mine, int root) {
  if (rank_ != root) {
    world_->Post(rank_, root, mine);
    return {};
  }
  std::vector<std::string> all(size());
  for (int peer = 0; peer < size(); ++peer) {
    all[peer] = peer == root ? mine : world_->Take(peer, root);
  }
  return all;
}

void LocalComm::BcastString(std::string* data, int root) {
  if (rank_ == root) {
    for (int peer = 0; peer < size(); ++peer) {
      if (peer != root) world_->Post(rank_, peer, *data);
    }
  } else {
    *data = world_->Take(root, rank_);
  }
}

// Rank 0 collects every contribution, ANDs them and sends the result back.
void LocalComm::StartBitAnd(uint64_t* words, int n) {
  bit_words_ = words;
  bit_count_ = n;
  std::string mine(reinterpret_cast<const char*>(words), n * sizeof(uint64_t));
  if (rank_ != 0) {
    world_->Post(rank_, 0, std::move(mine));
    return;
  }
  bit_parts_.assign(size(), std::string());
  bit_parts_[0] = std::move(mine);
  bit_parts_seen_ = 1;
}

bool LocalComm::TestBitAnd() {
  if (rank_ != 0) {
    std::string result;
    if (!world_->TryTake(0, rank_, &result)) return false;
    std::memcpy(bit_words_, result.data(), result.size());
    return true;
  }
  for (int peer = 1; peer < size(); ++peer) {
    if (bit_parts_[peer].empty() && world_->TryTake(peer, 0, &bit_parts_[peer])) {
      ++bit_parts_seen_;
    }
  }
  if (bit_parts_seen_ < size()) return false;
  for (int peer = 1; peer < size(); ++peer) {
    const uint64_t* theirs = reinterpret_cast<const uint64_t*>(bit_parts_[peer].data());
    for (int i = 0; i < bit_count_; ++i) bit_words_[i] &= theirs[i];
  }
  std::string result(reinterpret_cast<const char*>(bit_words_), bit_count_ * sizeof(uint64_t));
  for (int peer = 1; peer < size(); ++peer) world_->Post(0, peer, result);
  return true;
}

}  // namespace hvdmx
