#include "comm/local_comm.h"

#include <cstring>
#include <iterator>
#include <utility>

namespace hvdmx {

void LocalWorld::Post(int src, int dst, std::string message, bool report) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    boxes_[src * size_ + dst].push_back(Message{std::move(message), report});
  }
  cv_.notify_all();
}

void LocalWorld::LinkOnly(const std::vector<std::vector<int>>& links) {
  HVDMX_CHECK(static_cast<int>(links.size()) == size_, "a list of links for every rank");
  linked_.assign(static_cast<size_t>(size_) * size_, false);
  bool every = true;
  for (int a = 0; a < size_; ++a) {
    for (int b : links[a]) {
      HVDMX_CHECK(b >= 0 && b < size_ && b != a, "a link to rank " + std::to_string(b));
      linked_[a * size_ + b] = true;
    }
  }
  for (int a = 0; a < size_; ++a) {
    for (int b = 0; b < size_; ++b) {
      HVDMX_CHECK(linked_[a * size_ + b] == linked_[b * size_ + a], "asymmetric links");
      every = every && (a == b || linked_[a * size_ + b]);
    }
  }
  if (every) linked_.clear();
}

void LocalWorld::Cut(const std::string& why) {
  HVDMX_CHECK(!why.empty(), "a reason for the cut");
  {
    std::lock_guard<std::mutex> lock(mu_);
    cut_ = why;
  }
  cv_.notify_all();
}

std::string LocalWorld::Take(int src, int dst, bool* report) {
  std::unique_lock<std::mutex> lock(mu_);
  auto& box = boxes_[src * size_ + dst];
  cv_.wait(lock, [&] { return !box.empty() || !cut_.empty(); });
  if (!cut_.empty()) throw PeerGone(src, cut_);
  std::string message = std::move(box.front().bytes);
  *report = box.front().report;
  box.pop_front();
  return message;
}

bool LocalWorld::TryTake(int src, int dst, std::string* out, bool* report) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& box = boxes_[src * size_ + dst];
  if (!cut_.empty()) throw PeerGone(src, cut_);
  if (box.empty()) return false;
  *out = std::move(box.front().bytes);
  *report = box.front().report;
  box.pop_front();
  return true;
}

void LocalComm::CheckLinked(int peer, const char* doing) const {
  if (world_->Linked(rank_, peer)) return;
  std::string links;
  for (int j = 0; j < size(); ++j) {
    if (j != rank_ && world_->Linked(rank_, j))
      links += (links.empty() ? "" : ", ") + std::to_string(j);
  }
  throw UnlinkedPeerError(peer, "hvdmx internal error: rank " + std::to_string(rank_) + " of " +
                                    std::to_string(size()) + " " + doing + " rank " +
                                    std::to_string(peer) +
                                    ", with which it has no link (it links with ranks " + links +
                                    "; Note [The data comm's links] in comm/p2p_comm.h)");
}

Comm::Request LocalComm::ISend(const void* buf, int64_t bytes, int peer) {
  CheckLinked(peer, "sent to");
  world_->Post(rank_, peer, std::string(static_cast<const char*>(buf), bytes));
  CountSent(bytes);
  return next_request_++;
}

Comm::Request LocalComm::IRecv(void* buf, int64_t bytes, int peer) {
  CheckLinked(peer, "posted a receive from");
  Request id = next_request_++;
  PendingRecv recv;
  recv.buf = buf;
  recv.bytes = bytes;
  recv.peer = peer;
  recvs_[id] = recv;
  return id;
}

Comm::Request LocalComm::IRecvAny(std::string* out, int peer, int64_t max_bytes) {
  CheckLinked(peer, "posted a receive from");
  Request id = next_request_++;
  PendingRecv recv;
  recv.bytes = -1;
  recv.any = out;
  recv.max_bytes = max_bytes;
  recv.peer = peer;
  recvs_[id] = recv;
  return id;
}

void LocalComm::FailProtocol(int peer, const std::string& what) {
  throw PeerProtocolError(peer, "hvdmx: rank " + std::to_string(peer) + " sent " + what +
                                    ", which the protocol does not allow");
}

void LocalComm::ReportStop(const std::string& finding) {
  constexpr char kPrefix[] = "hvdmx: ";
  const std::string text = finding.compare(0, sizeof(kPrefix) - 1, kPrefix) == 0
                               ? finding.substr(sizeof(kPrefix) - 1)
                               : finding;
  for (int j = 0; j < size(); ++j) {
    if (j != rank_ && world_->Linked(rank_, j)) world_->Post(rank_, j, text, /*report=*/true);
  }
}

void LocalComm::Deliver(PendingRecv* recv, std::string message, bool report) {
  if (report) {
    throw PeerProtocolError(
        recv->peer, "hvdmx: rank " + std::to_string(recv->peer) + " reports that " + message);
  }
  const int64_t got = static_cast<int64_t>(message.size());
  if (recv->bytes < 0) {
    if (got > recv->max_bytes) {
      FailProtocol(recv->peer, "a message of " + std::to_string(got) + " bytes where at most " +
                                   std::to_string(recv->max_bytes) + " were expected");
    }
    *recv->any = std::move(message);
  } else {
    if (got != recv->bytes) {
      FailProtocol(recv->peer, "a message of " + std::to_string(got) + " bytes where " +
                                   std::to_string(recv->bytes) + " were expected");
    }
    if (got > 0) std::memcpy(recv->buf, message.data(), message.size());
  }
  recv->done = true;
  CountReceived(got);
}

bool LocalComm::Progress(Request request, bool block) {
  auto it = recvs_.find(request);
  if (it == recvs_.end()) return true;  // a send: complete at once
  const int peer = it->second.peer;
  for (auto earlier = recvs_.begin(); earlier != std::next(it); ++earlier) {
    PendingRecv& recv = earlier->second;
    if (recv.done || recv.peer != peer) continue;
    std::string message;
    bool report = false;
    if (block) {
      message = world_->Take(peer, rank_, &report);
    } else if (!world_->TryTake(peer, rank_, &message, &report)) {
      return false;
    }
    Deliver(&recv, std::move(message), report);
  }
  return true;
}

bool LocalComm::Test(Request request) { return Progress(request, /*block=*/false); }

void LocalComm::Wait(Request request) {
  Progress(request, /*block=*/true);
  recvs_.erase(request);
}

void LocalComm::WaitAll(const std::vector<Request>& requests, Waiting waiting) {
  if (waiting == Waiting::kNegotiation && idle_) {
    for (int64_t i = 0;; ++i) {
      bool all = true;
      for (Request r : requests) all = Test(r) && all;
      if (all) break;
      if (!idle_(i)) throw CommAbandoned();
    }
  }
  for (Request r : requests) Wait(r);
}

}  // namespace hvdmx
