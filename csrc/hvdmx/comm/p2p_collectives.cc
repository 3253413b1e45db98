// P2PComm's collectives (comm/p2p_comm.h), written once over any transport
// that gives point-to-point messages: the binomial-tree broadcast (of
// bytes, and of a string of any size), the tree gather to a root, and the
// bit-and (rank to rank with its payload to rank 0, or by recursive
// doubling). TcpComm runs them between hosts;
// LocalComm runs them in the tests, one rank per thread.
#include <algorithm>
#include <cstring>
#include <set>
#include <string>
#include <utility>
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

// Note [The tree gather]
// ~~~~~~~~~~~~~~~~~~~~~~
// A gather runs the broadcast's tree backwards: each rank receives the
// records of its children's subtrees, appends them to its own and sends the
// lot to its parent, so that the root receives ceil(log2 n) messages rather
// than n - 1. A record is the rank (4 bytes), the length (8 bytes) and the
// string. What a child sends is input: each record must lie within the
// message and name a rank of that child's subtree, once; the child of
// relative rank c, whose lowest set bit is m, holds the ranks c .. c+m-1.
// Anything else fails the comm naming the child.

void AppendGatherRecord(int rank, const std::string& s, std::string* out) {
  const uint32_t r = static_cast<uint32_t>(rank);
  const uint64_t len = s.size();
  out->append(reinterpret_cast<const char*>(&r), 4);
  out->append(reinterpret_cast<const char*>(&len), 8);
  out->append(s);
}

void ParseGatherRecords(const std::string& message, const PeerSender& from, int size,
                        std::vector<std::pair<uint32_t, std::string>>* out) {
  out->clear();
  PeerInput in(message, from, "a gather");
  while (!in.done()) {
    const int64_t r = in.Int32In("record's rank", 0, size - 1);
    const int64_t len = in.Count("record's bytes", 1);
    out->emplace_back(static_cast<uint32_t>(r), in.Bytes(static_cast<size_t>(len), "record"));
  }
}

std::vector<std::string> P2PComm::Gather(const std::string& mine, int root) {
  // See Note [The tree gather].
  const int n = size();
  std::vector<int> children;
  const int parent = TreeLinks(rank(), n, root, &children);
  std::vector<std::string> in(children.size());
  std::vector<Request> recvs;
  for (size_t i = 0; i < children.size(); ++i) {
    recvs.push_back(IRecvAny(&in[i], children[i], kMaxMessageBytes));
  }
  WaitAll(recvs, Waiting::kNegotiation);
  std::vector<std::string> out(rank() == root ? n : 0);
  std::vector<bool> seen(n, false);
  std::string up;
  if (rank() == root) {
    out[root] = mine;
  } else {
    AppendGatherRecord(rank(), mine, &up);
  }
  for (size_t i = 0; i < children.size(); ++i) {
    const int child = children[i];
    const int c = (child - root + n) % n;
    const int span = std::min(c & -c, n - c);  // the child's subtree: c .. c+span-1
    std::vector<std::pair<uint32_t, std::string>> records;
    ParseGatherRecords(in[i], Sender(child), n, &records);
    for (const auto& record : records) {
      const uint32_t r = record.first;
      const int v = (static_cast<int>(r) - root + n) % n;
      if (v < c || v >= c + span || seen[r]) {
        FailProtocol(child, "a gather record for rank " + std::to_string(r) +
                                ", which is not of its subtree or came twice");
      }
      seen[r] = true;
      if (rank() == root) out[r] = record.second;
    }
    const int count = static_cast<int>(records.size());
    if (count != span) {
      FailProtocol(child, "a gather of " + std::to_string(count) +
                              " records where its subtree has " + std::to_string(span) + " ranks");
    }
    if (rank() != root) up += in[i];
  }
  if (parent >= 0) {
    WaitAll({ISend(up.data(), static_cast<int64_t>(up.size()), parent)}, Waiting::kNegotiation);
  }
  return out;
}

// Note [The bit-and over point-to-point]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Up to P2PComm::kDirectBitAndRanks ranks (4; TcpOptions::direct_bit_and_ranks and
// LocalComm's constructor may set another number), every rank sends its
// words to every other at once, rank 0's copy followed by its payload, and
// each ANDs what it receives: a round costs one message's latency, and
// rank 0 has every rank's requests with it (Note [Requests with the
// bit-and] in negotiation/controller.h). That is 2(n-1) messages a rank,
// which beyond a few ranks costs more than it saves; so beyond, the ranks
// AND by recursive doubling and carry no payload. With p the largest power
// of two <= n, rank v >= p first hands its words to v - p and later gets
// the result from it; the ranks below p then exchange with v XOR 1, v XOR
// 2, ..., v XOR p/2, ANDing each time, and those below n - p send the
// result on to v + p. A round costs log2(p) latencies (2 more when n is not
// a power of two) and no rank sends or receives more than log2(p) + 1
// messages each way. Every message carries one word more, the hops: the
// longest chain of messages behind it, so that each rank knows the
// latencies on its critical path (last_bit_and_hops). AND does not depend
// on the order, so every rank gets the same words. A send may still be on
// its way when TestBitAnd returns true; the next bit-and waits for it
// before reusing its buffer, and a pair's messages keep their order, so it
// arrives before anything sent later.
//
// Every message also carries the sender's partial so far (BitAndReduction
// in comm/comm.h; an 8-byte length, then its bytes, empty when the caller
// combines nothing). Direct, each rank folds all n partials in rank order.
// By doubling, a rank combines a partial it receives with its own as the
// words are ANDed, the lower rank's partial first wherever two meet, so
// both partners of a step compute the same bytes; a rank v >= p takes the
// finished combination from v - p as it is. Either way every rank ends
// with the same bytes, combined in the same order.
//
// What a rank receives is checked before it is used: a message longer than
// expected (the words and hops, the largest partial, and at rank 0 when
// direct the largest payload) fails in the transport's IRecvAny, one
// shorter or with a partial that does not parse here; either fails the
// comm with PeerProtocolError naming the peer, never reading past what
// arrived.
namespace {

// The largest power of two p <= n: the doubling runs among ranks below p,
// and each rank v >= p folds into v - p.
int DoublingWidth(int n) {
  int p = 1;
  while (p * 2 <= n) p *= 2;
  return p;
}

// The doubling schedule of rank v of n (Note [The bit-and over
// point-to-point]), as (to, from) pairs; -1: none.
std::vector<std::pair<int, int>> DoublingSchedule(int v, int n) {
  const int p = DoublingWidth(n);
  std::vector<std::pair<int, int>> steps;
  if (v >= p) {
    steps.push_back({v - p, -1});
    steps.push_back({-1, v - p});
    return steps;
  }
  if (v < n - p) steps.push_back({-1, v + p});
  for (int mask = 1; mask < p; mask <<= 1) steps.push_back({v ^ mask, v ^ mask});
  if (v < n - p) steps.push_back({v + p, -1});
  return steps;
}

}  // namespace

std::vector<int> P2PComm::NegotiationPeers(int rank, int size, int direct_bit_and_ranks) {
  std::set<int> peers;
  if (size <= direct_bit_and_ranks) {
    for (int j = 0; j < size; ++j) peers.insert(j);
  } else {
    std::vector<int> children;
    const int parent = TreeLinks(rank, size, 0, &children);
    if (parent >= 0) peers.insert(parent);
    peers.insert(children.begin(), children.end());
    for (int j : DoublingPartners(rank, size)) peers.insert(j);
  }
  peers.erase(-1);
  peers.erase(rank);
  return std::vector<int>(peers.begin(), peers.end());
}

std::vector<int> P2PComm::DoublingPartners(int rank, int size) {
  std::set<int> partners;
  for (const auto& step : DoublingSchedule(rank, size)) {
    partners.insert(step.first);
    partners.insert(step.second);
  }
  partners.erase(-1);
  return std::vector<int>(partners.begin(), partners.end());
}

std::vector<int> P2PComm::DataPeers(int rank, int size, const std::vector<int>& more) {
  // See Note [The data comm's links] in p2p_comm.h.
  std::set<int> peers(more.begin(), more.end());
  for (int64_t step = 1; step < size; step *= 2) {
    peers.insert(static_cast<int>((rank + step) % size));
    peers.insert(static_cast<int>((rank - step % size + size) % size));
  }
  peers.erase(rank);
  return std::vector<int>(peers.begin(), peers.end());
}

void P2PComm::StartBitAndCombining(uint64_t* words, int n, const std::string& payload,
                                   BitAndPartial* partial) {
  HVDMX_CHECK(!bit_and_active_, "a bit-and is already outstanding");
  HVDMX_CHECK(static_cast<int64_t>(payload.size()) <= BitAndPayloadCapacity(),
              "bit-and payload too big");
  HVDMX_CHECK(partial == nullptr || partial->Ready(),
              "a bit-and partial needs its reduction and at most BitAndPartial::kMaxBytes");
  WaitAll(bit_sends_, Waiting::kTransfer);
  bit_sends_.clear();
  bit_and_active_ = true;
  bit_words_ = words;
  bit_n_ = n;
  bit_direct_ = size() <= direct_bit_and_ranks_;
  bit_partial_ = partial;
  partial_ = partial != nullptr ? partial->mine : std::string();
  bit_extra_ = false;
  bit_requests_.clear();
  bit_out_.clear();
  bit_in_.clear();
  bit_from_.clear();
  if (!bit_direct_) {
    bit_hops_ = 0;
    bit_steps_.clear();
    bit_extra_ = rank() >= DoublingWidth(size());
    for (const auto& step : DoublingSchedule(rank(), size())) {
      bit_steps_.push_back(BitAndStep{step.first, step.second});
    }
    bit_step_ = 0;
    PostBitAndStep();
    return;
  }
  bit_hops_ = size() > 1 ? 1 : 0;
  const std::string mine = BitAndMessage();
  payloads_.assign(rank() == 0 ? size() : 0, std::string());
  if (rank() == 0) payloads_[0] = payload;
  bit_out_.push_back(mine);
  bit_out_.push_back(mine + payload);  // rank 0's copy
  bit_in_.resize(size());
  for (int j = 0; j < size(); ++j) {
    if (j == rank()) continue;
    const std::string& out = bit_out_[j == 0 ? 1 : 0];
    bit_sends_.push_back(ISend(out.data(), static_cast<int64_t>(out.size()), j));
    // Only rank 0 is sent payloads.
    const int64_t most = static_cast<int64_t>(n) * 8 + 8 + BitAndPartial::kMaxBytes +
                         (rank() == 0 ? kMaxPayloadBytes : 0);
    bit_requests_.push_back(IRecvAny(&bit_in_[j], j, most));
    bit_from_.push_back(j);
  }
}

std::string P2PComm::BitAndMessage() const {
  std::string out(reinterpret_cast<const char*>(bit_words_), static_cast<size_t>(bit_n_) * 8);
  if (!bit_direct_) {
    const uint64_t hops = static_cast<uint64_t>(bit_hops_);
    out.append(reinterpret_cast<const char*>(&hops), 8);
  }
  const uint64_t length = partial_.size();
  out.append(reinterpret_cast<const char*>(&length), 8);
  return out + partial_;
}

void P2PComm::PostBitAndStep() {
  const BitAndStep& step = bit_steps_[bit_step_];
  if (step.to >= 0) {
    bit_out_.push_back(BitAndMessage());
    bit_sends_.push_back(
        ISend(bit_out_.back().data(), static_cast<int64_t>(bit_out_.back().size()), step.to));
  }
  if (step.from >= 0) {
    bit_in_.emplace_back();
    bit_requests_.push_back(
        IRecvAny(&bit_in_.back(), step.from,
                 static_cast<int64_t>(bit_n_ + 2) * 8 + BitAndPartial::kMaxBytes));
    bit_from_.push_back(step.from);
  }
}

size_t P2PComm::AndIn(int peer, const std::string& message, std::string* partial) {
  const size_t word_bytes = static_cast<size_t>(bit_n_) * 8 + (bit_direct_ ? 0 : 8);
  if (message.size() < word_bytes + 8) {
    FailProtocol(peer, "a bit-and of " + std::to_string(message.size()) + " bytes where " +
                           std::to_string(word_bytes + 8) +
                           " were expected (do the ranks' HVDMX_CACHE_CAPACITY differ?)");
  }
  for (int w = 0; w < bit_n_; ++w) {
    uint64_t theirs;
    std::memcpy(&theirs, message.data() + size_t{8} * w, 8);
    bit_words_[w] &= theirs;
  }
  if (!bit_direct_) {
    uint64_t hops = 0;
    std::memcpy(&hops, message.data() + size_t{8} * bit_n_, 8);
    if (hops >= static_cast<uint64_t>(size())) {
      FailProtocol(peer, "a bit-and that says it took " + std::to_string(hops) + " hops among " +
                             std::to_string(size()) + " ranks");
    }
    bit_hops_ = std::max(bit_hops_, static_cast<int>(hops) + 1);
  }
  uint64_t length = 0;
  std::memcpy(&length, message.data() + word_bytes, 8);
  const size_t rest = message.size() - word_bytes - 8;
  if (length > static_cast<uint64_t>(BitAndPartial::kMaxBytes) || length > rest) {
    FailProtocol(peer, "a bit-and partial of " + std::to_string(length) + " bytes, where " +
                           std::to_string(rest) + " followed and at most " +
                           std::to_string(BitAndPartial::kMaxBytes) + " may");
  }
  partial->assign(message, word_bytes + 8, static_cast<size_t>(length));
  return word_bytes + 8 + static_cast<size_t>(length);
}

void P2PComm::CheckPartial(int peer, const std::string& theirs) {
  bit_partial_->reduction->Check(theirs, Sender(peer));
}

void P2PComm::CombineIn(int peer, const std::string& theirs) {
  if (bit_partial_ == nullptr) return;  // a bit-and that combines nothing here
  CheckPartial(peer, theirs);
  const BitAndReduction& reduction = *bit_partial_->reduction;
  if (bit_extra_) {
    partial_ = theirs;  // the finished combination, from v - p
  } else if (peer < rank()) {
    partial_ = reduction.Combine(theirs, partial_, Sender(peer));
  } else {
    partial_ = reduction.Combine(partial_, theirs, Sender(peer));
  }
}

bool P2PComm::TestBitAnd() {
  HVDMX_CHECK(bit_and_active_, "no bit-and is outstanding");
  for (;;) {
    for (Request r : bit_requests_) {
      if (!Test(r)) return false;
    }
    WaitAll(bit_requests_, Waiting::kTransfer);  // all done: releases them
    bit_requests_.clear();
    if (bit_direct_) {
      std::vector<std::string> partials(size());
      partials[rank()] = partial_;
      for (const int from : bit_from_) {
        const size_t at = AndIn(from, bit_in_[from], &partials[from]);
        if (rank() == 0) payloads_[from] = bit_in_[from].substr(at);
        if (bit_partial_ != nullptr) CheckPartial(from, partials[from]);
      }
      // Every rank folds the partials in rank order: the same bytes everywhere.
      if (bit_partial_ != nullptr) {
        partial_ = partials[0];
        for (int j = 1; j < size(); ++j) {
          partial_ = bit_partial_->reduction->Combine(partial_, partials[j], Sender(j));
        }
      }
    } else {
      for (size_t i = 0; i < bit_from_.size(); ++i) {
        std::string theirs;
        AndIn(bit_from_[i], bit_in_[i], &theirs);
        CombineIn(bit_from_[i], theirs);
      }
    }
    bit_from_.clear();
    bit_in_.clear();
    if (bit_direct_ || ++bit_step_ == bit_steps_.size()) break;
    PostBitAndStep();
  }
  if (bit_partial_ != nullptr) bit_partial_->combined = std::move(partial_);
  partial_.clear();
  bit_and_active_ = false;
  return true;
}

std::string P2PComm::BitAndPayload(int rank) const {
  HVDMX_CHECK(this->rank() == 0 && rank >= 0 && rank < size() && bit_direct_,
              "bit-and payloads are rank 0's, and travel only while bit-ands are direct");
  return payloads_[rank];
}

}  // namespace hvdmx
