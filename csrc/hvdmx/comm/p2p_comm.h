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

#include <atomic>
#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "comm/comm.h"
#include "comm/peer_input.h"

namespace hvdmx {

// A send or receive posted to a rank this one has no link with (TcpOptions::
// peers, LocalComm's links): our bug, not the user's, but one that fails the
// comm with a message naming both ranks instead of waiting forever for a
// message that cannot come.
class UnlinkedPeerError : public PeerGone {
 public:
  using PeerGone::PeerGone;
};

// What a comm has sent and received so far (messages and their bytes,
// frames' headers not counted): the scale harness reads it before and
// after a round.
struct Traffic {
  int64_t sent_messages = 0;
  int64_t sent_bytes = 0;
  int64_t received_messages = 0;
  int64_t received_bytes = 0;
};

// A gather's messages are lists of records, a rank and its string (Note
// [The tree gather] in comm/p2p_collectives.cc). ParseGatherRecords reads
// one, which `from` sent, into *out; a record cut short, longer than what
// remains or for a rank outside [0, size) throws PeerProtocolError naming
// `from` (Note [Peer input] in comm/peer_input.h).
void AppendGatherRecord(int rank, const std::string& s, std::string* out);
void ParseGatherRecords(const std::string& message, const PeerSender& from, int size,
                        std::vector<std::pair<uint32_t, std::string>>* out);

class P2PComm : public Comm {
 public:
  // Up to this many ranks a bit-and goes from every rank to every other;
  // beyond, by recursive doubling (Note [The bit-and over point-to-point]
  // in comm/p2p_collectives.cc).
  static constexpr int kDirectBitAndRanks = 4;
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
  // How an error about what `peer` sent names it (Note [Peer input] in
  // comm/peer_input.h); a transport that knows more than the rank says it.
  virtual PeerSender Sender(int peer) const { return PeerSender::Rank(peer); }

  // The collectives, written once over the above (comm/p2p_collectives.cc).
  // Bcast, BcastString and Gather go along the binomial tree from or to
  // their root (Note [The binomial tree]).
  void Bcast(void* buf, int64_t bytes, int root) final;
  std::vector<std::string> Gather(const std::string& mine, int root) final;
  void BcastString(std::string* data, int root) final;
  void StartBitAnd(uint64_t* words, int n) final { StartBitAndCombining(words, n, "", nullptr); }
  bool TestBitAnd() final;
  // Payloads travel only while bit-ands go from every rank to every other.
  int64_t BitAndPayloadCapacity() const final {
    return size() <= direct_bit_and_ranks_ ? kMaxPayloadBytes : 0;
  }
  void StartBitAndWithPayload(uint64_t* words, int n, const std::string& payload) final {
    StartBitAndCombining(words, n, payload, nullptr);
  }
  std::string BitAndPayload(int rank) const final;
  // Partials ride in every bit-and message, combined where messages meet
  // (Note [The bit-and over point-to-point]); `partial` may be null.
  bool CombinesPartials() const final { return true; }
  void StartBitAndCombining(uint64_t* words, int n, const std::string& payload,
                            BitAndPartial* partial) final;

  // The network latencies on the critical path of the last bit-and: the
  // longest chain of messages, each sent after the one before it arrived,
  // that ends at this rank (1 when direct, about log2(n) by doubling).
  int last_bit_and_hops() const { return bit_hops_; }
  // Any thread may call it.
  Traffic traffic() const {
    Traffic t;
    t.sent_messages = sent_messages_.load(std::memory_order_relaxed);
    t.sent_bytes = sent_bytes_.load(std::memory_order_relaxed);
    t.received_messages = received_messages_.load(std::memory_order_relaxed);
    t.received_bytes = received_bytes_.load(std::memory_order_relaxed);
    return t;
  }

  // The ranks that `rank` of `size` exchanges messages with in the
  // negotiation's collectives (bit-ands, and gathers and string broadcasts
  // rooted at rank 0), in ascending order: every other rank while bit-ands
  // are direct; beyond, its tree and doubling partners, O(log n) of them.
  // Symmetric: j is in rank's list if and only if rank is in j's.
  static std::vector<int> NegotiationPeers(int rank, int size, int direct_bit_and_ranks);
  // The ranks `rank` of `size` exchanges with in recursive doubling or
  // halving with the extra ranks folded in (the bit-and's schedule, Note
  // [The bit-and over point-to-point]; Adasum's over a group), ascending.
  static std::vector<int> DoublingPartners(int rank, int size);

  // Note [The data comm's links]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // The comm that carries the collectives' bytes (the job's, a process
  // set's, the ring between hosts) links rank r of n with the ranks
  // (r + 2^k) mod n and (r - 2^k) mod n for every 2^k < n: at most
  // 2 ceil(log2 n) of them (fewer where they coincide), instead of all n - 1.
  // Every algorithm that runs over such a comm talks only to those:
  //   - the ring (allreduce, allgather, reducescatter, the ring between
  //     hosts): r - 1 and r + 1;
  //   - the binomial tree of a broadcast from any root (Note [The binomial
  //     tree] in comm/p2p_collectives.cc): relative to the root, a parent
  //     and children differ from r by a power of two, and so do the ranks
  //     themselves, mod n;
  //   - recursive doubling and halving (flat Adasum): the partner v XOR 2^k
  //     is v + 2^k or v - 2^k, and a non-power-of-two's extra rank v >= p
  //     pairs with v - p, p a power of two below n;
  //   - Bruck's allgather and alltoall (algorithms/bruck.h), which take the
  //     place of every-rank-to-every-rank exchanges (exchange_allreduce,
  //     alltoall, finding Adasum's hosts) when the comm does not link every
  //     pair (Comm::LinksEveryPair): step k sends to r + 2^k or r - 2^k.
  // The relation is symmetric (j = r + 2^k exactly when r = j - 2^k), as
  // TcpOptions::peers requires. Up to 5 ranks the set is every other rank.
  // The hierarchical Adasum pairs ranks by host, which no formula of r and n
  // knows: the job adds those pairs to the set (AdasumHierarchicalPeers in
  // algorithms/adasum.h). A send to a rank outside the set fails with
  // UnlinkedPeerError naming both ranks.
  //
  // Returns the set for `rank` of `size` and the ranks of `more` (the
  // hierarchical Adasum's), ascending, without `rank`.
  static std::vector<int> DataPeers(int rank, int size, const std::vector<int>& more = {});

 protected:
  // What the transport counts as it moves messages.
  void CountSent(int64_t bytes) {
    sent_messages_.fetch_add(1, std::memory_order_relaxed);
    sent_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  }
  void CountReceived(int64_t bytes) {
    received_messages_.fetch_add(1, std::memory_order_relaxed);
    received_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  }

 private:
  // One step of a bit-and: send this rank's words so far to `to`, and AND
  // in what `from` sends (-1: none).
  struct BitAndStep {
    int to = -1;
    int from = -1;
  };
  // Posts step bit_step_'s messages.
  void PostBitAndStep();
  // This rank's bit-and message so far: its words, the hops when doubling,
  // then its partial with its length.
  std::string BitAndMessage() const;
  // ANDs a received bit-and message from `peer` into the words, and takes
  // its partial into *partial; returns where the message's payload starts.
  size_t AndIn(int peer, const std::string& message, std::string* partial);
  // Fails the comm naming `peer` when `theirs`, its partial, does not parse.
  void CheckPartial(int peer, const std::string& theirs);
  // Doubling: checks the partial `theirs` that `peer` sent and combines it
  // into this rank's by the rule of Note [The bit-and over point-to-point].
  void CombineIn(int peer, const std::string& theirs);

  int direct_bit_and_ranks_;
  std::atomic<int64_t> sent_messages_{0};
  std::atomic<int64_t> sent_bytes_{0};
  std::atomic<int64_t> received_messages_{0};
  std::atomic<int64_t> received_bytes_{0};
  // The bit-and in flight.
  bool bit_and_active_ = false;
  bool bit_direct_ = true;
  uint64_t* bit_words_ = nullptr;
  int bit_n_ = 0;
  int bit_hops_ = 0;
  std::vector<BitAndStep> bit_steps_;     // doubling: the schedule
  size_t bit_step_ = 0;                   // doubling: the step in flight
  std::deque<std::string> bit_out_;       // what each send carries, kept until sent
  std::vector<std::string> bit_in_;       // what each peer (direct) or step (doubling) sent
  std::vector<int> bit_from_;             // whose message each bit_in_ is
  std::vector<std::string> payloads_;     // rank 0: each rank's payload
  BitAndPartial* bit_partial_ = nullptr;  // the caller's, or null
  std::string partial_;                   // the partial so far (empty without one)
  bool bit_extra_ = false;                // doubling: this rank is beyond the power of two
  std::vector<Request> bit_requests_;     // the receives in flight
  std::vector<Request> bit_sends_;        // the sends, waited at the next start
};

}  // namespace hvdmx

#endif  // HVDMX_P2P_COMM_H_
