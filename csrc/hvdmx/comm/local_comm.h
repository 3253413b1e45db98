// An in-process Comm: one rank per thread, messages through mailboxes.
// It exists so that the ring, the negotiation round and the collectives
// TcpComm runs can be tested at any size without MPI or sockets (STYLE.md):
// it is a P2PComm, so its broadcast, gather and bit-and are the ones of
// comm/p2p_collectives.cc. Sends copy at once and never block; a pair's
// messages are received in the order they were sent.
//
// LocalWorld owns the mailboxes; each rank's thread holds its own LocalComm.
#ifndef HVDMX_LOCAL_COMM_H_
#define HVDMX_LOCAL_COMM_H_

#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/p2p_comm.h"

namespace hvdmx {

class LocalWorld {
 public:
  explicit LocalWorld(int size) : size_(size), boxes_(size * size) {}
  int size() const { return size_; }

  // Links rank r only with links[r] (symmetric; as TcpOptions::peers, the
  // tests give P2PComm::DataPeers): a send or receive posted to another rank
  // throws UnlinkedPeerError, as TcpComm's does. Called before the ranks
  // start; unset: every pair.
  void LinkOnly(const std::vector<std::vector<int>>& links);
  bool Linked(int a, int b) const { return linked_.empty() || linked_[a * size_ + b]; }
  bool links_every_pair() const { return linked_.empty(); }

  // `report`: the message is a report (LocalComm::ReportStop), not one of
  // the comm's; Take and TryTake say which in *report.
  void Post(int src, int dst, std::string message, bool report = false);
  // Blocks until a message from src to dst is there.
  std::string Take(int src, int dst, bool* report);
  // Takes one if there is one.
  bool TryTake(int src, int dst, std::string* out, bool* report);
  // From now on, every Take and TryTake throws PeerGone with `why`, as a
  // rank's transport does when its peer's process ends: for the tests of
  // what a runtime does when its peers go (every rank's next receive fails,
  // so that no rank goes on to wait for the others).
  void Cut(const std::string& why);

 private:
  int size_;
  std::mutex mu_;
  std::condition_variable cv_;
  struct Message {
    std::string bytes;
    bool report = false;
  };
  std::vector<std::deque<Message>> boxes_;  // index src * size + dst
  std::vector<bool> linked_;                // index a * size + b; empty: every pair
  std::string cut_;                         // Cut's reason; empty: not cut
};

class LocalComm : public P2PComm {
 public:
  // Bit-ands go from every rank to every other up to `direct_bit_and_ranks`
  // ranks, by recursive doubling beyond (as TcpOptions::direct_bit_and_ranks).
  LocalComm(std::shared_ptr<LocalWorld> world, int rank,
            int direct_bit_and_ranks = kDirectBitAndRanks)
      : P2PComm(direct_bit_and_ranks), world_(std::move(world)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return world_->size(); }
  // As its world says (LocalWorld::LinkOnly).
  bool LinksEveryPair() const override { return world_->links_every_pair(); }

  Request ISend(const void* buf, int64_t bytes, int peer) override;
  Request IRecv(void* buf, int64_t bytes, int peer) override;
  void Wait(Request request) override;
  Request IRecvAny(std::string* out, int peer, int64_t max_bytes) override;
  bool Test(Request request) override;
  // kNegotiation with an idle function polls, calling it between polls.
  void WaitAll(const std::vector<Request>& requests, Waiting waiting) override;
  [[noreturn]] void FailProtocol(int peer, const std::string& what) override;
  // As TcpComm's (Note [A rank's finding reaches every rank] in
  // negotiation/controller.h): a report to every linked rank, which its
  // next receive from this rank throws as PeerProtocolError.
  void ReportStop(const std::string& finding) override;
  bool NativeAllreduce(void*, int64_t, DataType, ReduceOp) override { return false; }

 private:
  struct PendingRecv {
    void* buf = nullptr;         // a receive of known size: where it lands
    int64_t bytes = 0;           // its size; -1: a receive of any size
    std::string* any = nullptr;  // a receive of any size lands here
    int64_t max_bytes = 0;       // the most it takes
    int peer = 0;
    bool done = false;
  };
  // Completes the receives from request's peer up to and including it, in
  // the order they were posted; without `block`, stops at the first whose
  // message is not there yet. True if `request` is done.
  bool Progress(Request request, bool block);
  void Deliver(PendingRecv* recv, std::string message, bool report);
  // Throws UnlinkedPeerError unless this rank links with `peer`.
  void CheckLinked(int peer, const char* doing) const;

  std::shared_ptr<LocalWorld> world_;
  int rank_;
  std::map<Request, PendingRecv> recvs_;  // sends complete at once and are not kept
  Request next_request_ = 0;
};

}  // namespace hvdmx

#endif  // HVDMX_LOCAL_COMM_H_
