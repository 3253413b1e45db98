// A Comm whose collectives are made of its own point-to-point messages:
// what a transport must add to Comm's ISend/IRecv/Wait so that the tree
// broadcast, the gather and the bit-and can be written once over it
// (comm/p2p_collectives.cc) and run by every such transport alike. TcpComm
// (comm/tcp_comm.h) and LocalComm (comm/local_comm.h) are two; the tests
// run the latter at any size in one process, so the collectives TCP runs
// between hosts are the ones they check. MpiComm keeps MPI's own calls.
//
// Threading: as Comm's; the collectives run on the calling thread.
#ifndef HVDMX_P2P_COMM_H_
#define HVDMX_P2P_COMM_H_

#include <cstdint>
#include <string>
#include <vector>

#include "comm/comm.h"

namespace hvdmx {

// A peer sent what the protocol does not allow (a message of another size
// than the one posted, a length over the limit, a bit-and shorter than its
// words): the comm cannot go on. The message names the peer and what it
// sent.
class PeerProtocolError : public PeerGone {
 public:
  using PeerGone::PeerGone;
};

class P2PComm : public Comm {
 public:
  // Up to this many ranks a bit-and goes from every rank to every other;
  // beyond, through rank 0 (Note [The bit-and over point-to-point] in
  // comm/p2p_collectives.cc).
  static constexpr int kDirectBitAndRanks = 16;
  // The most a bit-and's payload may hold.
  static constexpr int64_t kMaxPayloadBytes = int64_t{64} << 20;

  explicit P2PComm(int direct_bit_and_ranks) : direct_bit_and_ranks_(direct_bit_and_ranks) {}

  // What the transport adds. A receive of any size up to `max_bytes`,
  // which lands in *out; a longer message fails the comm (FailProtocol).
  virtual Request IRecvAny(std::string* out, int peer, int64_t max_bytes) = 0;
  // Whether `request` is done, moving what can move without blocking. A
  // done request still goes to Wait or WaitAll, which then return at once.
  virtual bool Test(Request request) = 0;
  // How a wait for a set of requests behaves. kNegotiation: between polls
  // it calls the idle function (Comm::set_idle), throwing CommAbandoned
  // when that returns false, and its errors say it waited in negotiation.
  // kTransfer: it waits as Wait does.
  enum class Waiting { kTransfer, kNegotiation };
  // Waits for every request, as Wait does for one (each passed once).
  virtual void WaitAll(const std::vector<Request>& requests, Waiting waiting) = 0;
  // Throws PeerProtocolError saying that `peer` sent `what`.
  [[noreturn]] virtual void FailProtocol(int peer, const std::string& what) = 0;

  // The collectives, written once over the above (comm/p2p_collectives.cc).
  void Bcast(void* buf, int64_t bytes, int root) final;
  std::vector<std::string> Gather(const std::string& mine, int root) final;
  void BcastString(std::string* data, int root) final;
  void StartBitAnd(uint64_t* words, int n) final { StartBitAndWithPayload(words, n, ""); }
  bool TestBitAnd() final;
  int64_t BitAndPayloadCapacity() const final { return kMaxPayloadBytes; }
  void StartBitAndWithPayload(uint64_t* words, int n, const std::string& payload) final;
  std::string BitAndPayload(int rank) const final;

 private:
  // Whether a bit-and exchanges words with `peer` (Note [The bit-and over
  // point-to-point]).
  bool BitAndLinks(int peer) const;

  int direct_bit_and_ranks_;
  // The bit-and in flight.
  bool bit_and_active_ = false;
  uint64_t* bit_words_ = nullptr;
  int bit_n_ = 0;
  std::string bit_mine_;               // this rank's words (rank 0 beyond the direct size: the AND)
  std::string bit_up_;                 // the words and payload, for rank 0
  std::vector<std::string> bit_in_;    // what each rank sent
  std::vector<std::string> payloads_;  // rank 0: each rank's payload
  std::vector<Request> bit_requests_;  // the receives
  std::vector<Request> bit_sends_;     // the sends, waited at the next start
};

}  // namespace hvdmx

#endif  // HVDMX_P2P_COMM_H_
