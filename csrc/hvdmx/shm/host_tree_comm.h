// The control communicator of a job that spans hosts with the same number
// of ranks on each (where the allreduce is hierarchical, shm_host.h): the
// negotiation in log(hosts) network latencies, the network touched by one
// rank a host.
//
// Note [Negotiation across hosts]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A flat bit-and over every rank of every host costs messages between
// ranks that share memory, and at n ranks log2(n) latencies at best. Here a
// round's bit-and runs in three parts:
//   1. the host's ranks AND their words through shared memory (ShmControl);
//   2. the host's leader (local rank 0) ANDs the host's words with the
//      other leaders' over the network: a P2PComm over the leaders, by
//      recursive doubling beyond a few hosts (Note [The bit-and over
//      point-to-point] in comm/p2p_collectives.cc), so ceil(log2 H)
//      latencies (2 more when H is not a power of two) and at most
//      log2(H) + 1 messages each way for any rank;
//   3. a second shared-memory bit-and hands the result to the host: the
//      leader gives its words (and the hops of part 2 as its payload), the
//      others all ones.
// A partial (BitAndReduction in comm/comm.h) takes the same road: each rank
// gives its own as part 1's payload, the leader folds the host's in local
// rank order and combines the result with the other leaders' in part 2,
// and hands the combination to the host after the hops in part 3.
// Ranks that are not leaders send and receive nothing over the network.
// The slow path's gather and broadcast (negotiation/controller.h, step 4)
// take the same road: the host's strings reach the leader in shared-memory
// rounds (as bit-and payloads, in pieces of a mailbox each), the leaders
// gather theirs up the binomial tree to global rank 0 (Note [The tree
// gather]), each leader's message a list of (global rank, string) records;
// the responses come back down the tree and out through shared memory. A
// leader's records are input like any peer's: rank 0 checks that every
// rank is named once, each by the leader of its host's count of ranks, and
// fails the comm naming the leader otherwise.
//
// Threading: as Comm's.
#ifndef HVDMX_HOST_TREE_COMM_H_
#define HVDMX_HOST_TREE_COMM_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/p2p_comm.h"
#include "shm/shm_control.h"

namespace hvdmx {

class HostTreeComm : public ControlComm {
 public:
  // `shm`: this host's control channel, in which this rank is `local_rank`
  // of `local_size` (every host has as many); it outlives this comm.
  // `leaders`: on local rank 0, a comm over the hosts' local ranks 0 whose
  // rank 0 is this comm's rank 0; nullptr on the other ranks. This rank is
  // `rank` of `size` in all.
  HostTreeComm(ShmControl* shm, int local_rank, int local_size, std::unique_ptr<P2PComm> leaders,
               int rank, int size);

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  // The negotiation's calls (Note [Negotiation across hosts]); Gather and
  // BcastString take root 0 only, as the controller uses them.
  std::vector<std::string> Gather(const std::string& mine, int root) override;
  void BcastString(std::string* data, int root) override;
  void StartBitAnd(uint64_t* words, int n) override { StartBitAndCombining(words, n, "", nullptr); }
  bool TestBitAnd() override;
  bool CombinesPartials() const override { return true; }
  // `payload` must be empty: this comm carries none (BitAndPayloadCapacity).
  void StartBitAndCombining(uint64_t* words, int n, const std::string& payload,
                            BitAndPartial* partial) override;
  void set_idle(std::function<bool(int64_t)> idle) override;
  // A leader waiting for the network blocks in poll(2) on its sockets;
  // waits in shared memory poll.
  bool WakesOnArrival() const override { return in_network_; }
  void AwaitArrival(int64_t waited_micros) override { leaders_->AwaitArrival(waited_micros); }
  // A leader tells the other leaders it is linked with; the host's other
  // ranks learn of its stop through shared memory (Note [A peer that
  // stops] in shm/shm_region.h), and a non-leader's finding goes nowhere.
  void ReportStop(const std::string& finding) override {
    if (leaders_) leaders_->ReportStop(finding);
  }

  // The network latencies on the critical path of the last bit-and (part
  // 2's, the same on every rank of a host), and the leaders' comm (nullptr
  // on the other ranks), for the scale harness.
  int last_bit_and_hops() const { return hops_; }
  const P2PComm* leaders() const { return leaders_.get(); }

 private:
  enum class Phase { kIdle, kHost, kLeaders, kResult };
  // Part 3: starts the bit-and that hands the result to the host.
  void StartResult();
  // Waits for the shared-memory bit-and in flight, calling the idle function.
  void AwaitShm();
  // After part 1: the host's partials folded in local rank order.
  std::string FoldHost();
  // Throws PeerProtocolError naming local rank `j` when `partial`, which it
  // gave, does not parse.
  void CheckFrom(int j, const std::string& partial) const;
  // How errors name local rank `j` (Note [Peer input] in comm/peer_input.h).
  static PeerSender LocalSender(int j);
  bool leader() const { return local_rank_ == 0; }

  ShmControl* shm_;
  int local_rank_;
  int local_size_;
  std::unique_ptr<P2PComm> leaders_;
  int rank_;
  int size_;
  Phase phase_ = Phase::kIdle;
  bool in_network_ = false;
  uint64_t* words_ = nullptr;
  int n_ = 0;
  int hops_ = 0;
  std::vector<uint64_t> ones_;        // a non-leader's part-3 words
  BitAndPartial* partial_ = nullptr;  // the caller's, or null
  BitAndPartial leaders_partial_;     // the leader's side of part 2
};

}  // namespace hvdmx

#endif  // HVDMX_HOST_TREE_COMM_H_
