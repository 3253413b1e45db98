// P2PComm's collectives (comm/p2p_comm.h), written once over any transport
// that gives point-to-point messages: the binomial-tree broadcast (of
// bytes, and of a string of any size), the gather to a root, and the
// bit-and with its payload to rank 0. TcpComm runs them between hosts;
// LocalComm runs them in the tests, one rank per thread.
#include <cstring>
#include <string>
#include <vector>

#include "comm/p2p_comm.h"

namespace hvdmx {
namespace {

// Note [The binomial tree]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A broadcast renumbers the ranks relative to the root, v = (rank - root)
// mod n, so that the root is 0. Rank v receives from the rank that differs
// from it in its lowest set bit (v - mask, mask = that bit), and then sends
// to v + mask' for every smaller power of two mask' (highest first, so that
// the farthest subtree starts first) while v + mask' < n. Each rank receives
// once and the bytes reach every rank in ceil(log2 n) steps, the root doing
// the most sends (one per bit). The root, with no bit set, only sends.
//
// Returns the rank that `rank` receives from (-1 for the root), and puts
// the ranks it sends to in *children, in the order to send.
int TreeLinks(int rank, int size, int root, std::vector<int>* children) {
  const int v = (rank - root + size) % size;
  int parent = -1;
  int mask = 1;
  while (mask < size) {
    if (v & mask) {
      parent = (v - mask + root) % size;
      break;
    }
    mask <<= 1;
  }
  children->clear();
  for (mask >>= 1; mask > 0; mask >>= 1) {
    if (v + mask < size) children->push_back((v + mask + root) % size);
  }
  return parent;
}

}  // namespace

void P2PComm::Bcast(void* buf, int64_t bytes, int root) {
  // See Note [The binomial tree].
  std::vector<int> children;
  const int parent = TreeLinks(rank(), size(), root, &children);
  if (parent >= 0) Wait(IRecv(buf, bytes, parent));
  std::vector<Request> sends;
  for (int child : children) sends.push_back(ISend(buf, bytes, child));
  WaitAll(sends, Waiting::kTransfer);
}

void P2PComm::BcastString(std::string* data, int root) {
  // See Note [The binomial tree]; each rank learns the size from its parent's
  // message.
  std::vector<int> children;
  const int parent = TreeLinks(rank(), size(), root, &children);
  if (parent >= 0) WaitAll({IRecvAny(data, parent, kMaxMessageBytes)}, Waiting::kNegotiation);
  std::vector<Request> sends;
  for (int child : children) {
    sends.push_back(ISend(data->data(), static_cast<int64_t>(data->size()), child));
  }
  WaitAll(sends, Waiting::kNegotiation);
}

std::vector<std::string> P2PComm::Gather(const std::string& mine, int root) {
  // Every rank sends the root its string at once; the root takes them in
  // whatever order they arrive.
  std::vector<std::string> out;
  if (rank() != root) {
    WaitAll({ISend(mine.data(), static_cast<int64_t>(mine.size()), root)}, Waiting::kNegotiation);
    return out;
  }
  out.resize(size());
  out[root] = mine;
  std::vector<Request> recvs;
  for (int j = 0; j < size(); ++j) {
    if (j != root) recvs.push_back(IRecvAny(&out[j], j, kMaxMessageBytes));
  }
  WaitAll(recvs, Waiting::kNegotiation);
  return out;
}

// Note [The bit-and over point-to-point]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Up to P2PComm::kDirectBitAndRanks ranks (16; TcpOptions::direct_bit_and_ranks and
// LocalComm's constructor may set another number), every rank sends its
// words to every other at once, rank 0's copy followed by its payload, and
// each ANDs what it receives: a round costs one message's latency, and
// rank 0 has every rank's requests with it (Note [Requests with the
// bit-and] in negotiation/controller.h). Beyond, each rank sends rank 0 its
// words and payload and rank 0 sends the AND back down (two latencies,
// 2(n-1) messages in all rather than n(n-1)). AND does not depend on the
// order, so every rank gets the same words. A send may still be on its way
// when TestBitAnd returns true; the next bit-and waits for it before
// reusing its buffer, and a pair's messages keep their order, so it arrives
// before anything sent later.
//
// What a rank receives is checked before it is used: a message longer than
// the words (and, at rank 0, the largest payload) fails in the transport's
// IRecvAny, one shorter than the words here; either fails the comm with
// PeerProtocolError naming the peer, never reading past what arrived.
bool P2PComm::BitAndLinks(int peer) const {
  const bool direct = size() <= direct_bit_and_ranks_;
  return peer != rank() && (direct || rank() == 0 || peer == 0);
}

void P2PComm::StartBitAndWithPayload(uint64_t* words, int n, const std::string& payload) {
  HVDMX_CHECK(!bit_and_active_, "a bit-and is already outstanding");
  HVDMX_CHECK(static_cast<int64_t>(payload.size()) <= kMaxPayloadBytes, "bit-and payload too big");
  WaitAll(bit_sends_, Waiting::kTransfer);
  bit_sends_.clear();
  bit_and_active_ = true;
  bit_words_ = words;
  bit_n_ = n;
  const size_t word_bytes = static_cast<size_t>(n) * 8;
  const bool direct = size() <= direct_bit_and_ranks_;
  bit_mine_.assign(reinterpret_cast<const char*>(words), word_bytes);
  bit_up_ = bit_mine_ + payload;
  payloads_.assign(rank() == 0 ? size() : 0, std::string());
  if (rank() == 0) payloads_[0] = payload;
  bit_in_.assign(size(), std::string());
  bit_requests_.clear();
  for (int j = 0; j < size(); ++j) {
    if (!BitAndLinks(j)) continue;
    // Rank 0 sends first only when direct; beyond, it sends the AND later.
    if (direct || rank() != 0) {
      const std::string& out = j == 0 ? bit_up_ : bit_mine_;
      bit_sends_.push_back(ISend(out.data(), static_cast<int64_t>(out.size()), j));
    }
    // Only rank 0 is sent payloads.
    const int64_t most = static_cast<int64_t>(word_bytes) + (rank() == 0 ? kMaxPayloadBytes : 0);
    bit_requests_.push_back(IRecvAny(&bit_in_[j], j, most));
  }
}

bool P2PComm::TestBitAnd() {
  HVDMX_CHECK(bit_and_active_, "no bit-and is outstanding");
  for (Request r : bit_requests_) {
    if (!Test(r)) return false;
  }
  WaitAll(bit_requests_, Waiting::kTransfer);  // all done: releases them
  bit_requests_.clear();
  bit_and_active_ = false;
  const size_t word_bytes = static_cast<size_t>(bit_n_) * 8;
  for (int j = 0; j < size(); ++j) {
    if (!BitAndLinks(j)) continue;
    if (bit_in_[j].size() < word_bytes) {
      FailProtocol(j, "a bit-and of " + std::to_string(bit_in_[j].size()) + " bytes where " +
                          std::to_string(word_bytes) +
                          " were expected (do the ranks' HVDMX_CACHE_CAPACITY differ?)");
    }
    for (int w = 0; w < bit_n_; ++w) {
      uint64_t theirs;
      std::memcpy(&theirs, bit_in_[j].data() + size_t{8} * w, 8);
      bit_words_[w] &= theirs;
    }
    if (rank() == 0) payloads_[j] = bit_in_[j].substr(word_bytes);
  }
  if (rank() == 0 && size() > direct_bit_and_ranks_) {
    // The AND goes back down (rank 0 waited for every rank's words).
    bit_mine_.assign(reinterpret_cast<const char*>(bit_words_), word_bytes);
    for (int j = 1; j < size(); ++j) {
      bit_sends_.push_back(ISend(bit_mine_.data(), static_cast<int64_t>(word_bytes), j));
    }
  }
  return true;
}

std::string P2PComm::BitAndPayload(int rank) const {
  HVDMX_CHECK(this->rank() == 0 && rank >= 0 && rank < size(), "bit-and payloads are rank 0's");
  return payloads_[rank];
}

}  // namespace hvdmx
