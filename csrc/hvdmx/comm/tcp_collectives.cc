// TcpComm's collectives (comm/tcp_comm.h): broadcast, gather, string
// broadcast and the bit-and, on its point-to-point messages.
#include <string>
#include <vector>

#include "comm/tcp_comm.h"

namespace hvdmx {

void TcpComm::Bcast(void* buf, int64_t bytes, int root) {
  // A binomial tree over ranks relative to the root.
  const int v = (rank_ - root + size_) % size_;
  int mask = 1;
  while (mask < size_) {
    if (v & mask) {
      Wait(IRecv(buf, bytes, (v - mask + root) % size_));
      break;
    }
    mask <<= 1;
  }
  std::vector<Request> sends;
  for (mask >>= 1; mask > 0; mask >>= 1) {
    if (v + mask < size_) sends.push_back(ISend(buf, bytes, (v + mask + root) % size_));
  }
  for (Request r : sends) Wait(r);
}

std::vector<std::string> TcpComm::Gather(const std::string& mine, int root) {
  std::vector<std::string> out;
  if (rank_ != root) {
    Finish(ISend(mine.data(), static_cast<int64_t>(mine.size()), root), "negotiation", true);
    return out;
  }
  out.resize(size_);
  out[root] = mine;
  std::vector<Request> recvs;
  for (int j = 0; j < size_; ++j) {
    if (j != root) recvs.push_back(IRecvAny(&out[j], j, kMaxMessageBytes));
  }
  WaitUntil(
      [&] {
        for (Request r : recvs) {
          if (!ops_[r].done) return false;
        }
        return true;
      },
      "negotiation", /*use_idle=*/true);
  for (Request r : recvs) Free(r);
  return out;
}

void TcpComm::BcastString(std::string* data, int root) {
  const int v = (rank_ - root + size_) % size_;
  int mask = 1;
  while (mask < size_) {
    if (v & mask) {
      Finish(IRecvAny(data, (v - mask + root) % size_, kMaxMessageBytes), "negotiation", true);
      break;
    }
    mask <<= 1;
  }
  std::vector<Request> sends;
  for (mask >>= 1; mask > 0; mask >>= 1) {
    if (v + mask < size_) {
      sends.push_back(
          ISend(data->data(), static_cast<int64_t>(data->size()), (v + mask + root) % size_));
    }
  }
  for (Request r : sends) Finish(r, "negotiation", true);
}

// Note [The bit-and over TCP]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Up to TcpOptions::direct_bit_and_ranks ranks (16), every rank sends its words to every
// other at once, rank 0's copy followed by its payload, and each ANDs
// what it receives: a round costs one message's latency, and rank 0 has
// every rank's requests with it (Note [Requests with the bit-and] in
// negotiation/controller.h). Beyond, each rank sends rank 0 its words and
// payload and rank 0 sends the AND back down (two latencies, 2(n-1)
// messages in all rather than n(n-1)). AND does not depend on the order, so
// every rank gets the same words. A send may still be on its way when
// TestBitAnd returns true; the next bit-and waits for it before reusing its
// buffer, and a connection keeps it before anything sent later.
void TcpComm::StartBitAndWithPayload(uint64_t* words, int n, const std::string& payload) {
  HVDMX_CHECK(!bit_and_active_, "a bit-and is already outstanding");
  HVDMX_CHECK(static_cast<int64_t>(payload.size()) <= kMaxPayloadBytes, "bit-and payload too big");
  for (Request r : bit_sends_) Wait(r);
  bit_sends_.clear();
  bit_and_active_ = true;
  bit_words_ = words;
  bit_n_ = n;
  const size_t word_bytes = static_cast<size_t>(n) * 8;
  const bool direct = size_ <= options_.direct_bit_and_ranks;
  bit_mine_.assign(reinterpret_cast<const char*>(words), word_bytes);
  bit_up_ = bit_mine_ + payload;
  payloads_.assign(rank_ == 0 ? size_ : 0, std::string());
  if (rank_ == 0) payloads_[0] = payload;
  bit_in_.assign(size_, std::string());
  bit_requests_.clear();
  for (int j = 0; j < size_; ++j) {
    if (j == rank_ || (!direct && rank_ != 0 && j != 0)) continue;
    if (direct || rank_ != 0) {
      const std::string& out = j == 0 ? bit_up_ : bit_mine_;
      bit_sends_.push_back(ISend(out.data(), static_cast<int64_t>(out.size()), j));
    }
    // Only rank 0 is sent payloads.
    const int64_t most = static_cast<int64_t>(word_bytes) + (rank_ == 0 ? kMaxPayloadBytes : 0);
    bit_requests_.push_back(IRecvAny(&bit_in_[j], j, most));
  }
}

bool TcpComm::TestBitAnd() {
  HVDMX_CHECK(bit_and_active_, "no bit-and is outstanding");
  ProgressAll();
  for (Request r : bit_requests_) {
    if (!ops_[r].done) return false;
  }
  for (Request r : bit_requests_) Free(r);
  bit_requests_.clear();
  bit_and_active_ = false;
  const size_t word_bytes = static_cast<size_t>(bit_n_) * 8;
  const bool direct = size_ <= options_.direct_bit_and_ranks;
  for (int j = 0; j < size_; ++j) {
    if (j == rank_ || (!direct && rank_ != 0 && j != 0)) continue;
    if (bit_in_[j].size() < word_bytes) {
      FailProtocol(j, "a bit-and of " + std::to_string(bit_in_[j].size()) + " bytes where " +
                          std::to_string(word_bytes) +
                          " were expected (do the ranks' HVDMX_CACHE_CAPACITY differ?)");
    }
    const uint64_t* theirs = reinterpret_cast<const uint64_t*>(bit_in_[j].data());
    for (int w = 0; w < bit_n_; ++w) bit_words_[w] &= theirs[w];
    if (rank_ == 0) payloads_[j] = bit_in_[j].substr(word_bytes);
  }
  if (rank_ == 0 && !direct) {
    // The AND goes back down (rank 0 waited for every rank's words).
    bit_mine_.assign(reinterpret_cast<const char*>(bit_words_), word_bytes);
    for (int j = 1; j < size_; ++j) {
      bit_sends_.push_back(ISend(bit_mine_.data(), static_cast<int64_t>(word_bytes), j));
    }
  }
  return true;
}

std::string TcpComm::BitAndPayload(int rank) const {
  HVDMX_CHECK(rank_ == 0 && rank >= 0 && rank < size_, "bit-and payloads are rank 0's");
  return payloads_[rank];
}

}  // namespace hvdmx
