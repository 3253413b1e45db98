// An in-process Comm: one rank per thread, messages through mailboxes.
// It exists so that the ring and the negotiation round can be tested at any
// size without MPI (STYLE.md). Sends copy at once and never block.
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

#include "comm/comm.h"

namespace hvdmx {

class LocalWorld {
 public:
  explicit LocalWorld(int size) : size_(size), boxes_(size * size) {}
  int size() const { return size_; }

  void Post(int src, int dst, std::string message);
  // Blocks until a message from src to dst is there.
  std::string Take(int src, int dst);
  // Takes one if there is one.
  bool TryTake(int src, int dst, std::string* out);

 private:
  int size_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::deque<std::string>> boxes_;  // index src * size + dst
};

class LocalComm : public Comm {
 public:
  LocalComm(std::shared_ptr<LocalWorld> world, int rank) : world_(std::move(world)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return world_->size(); }

  Request ISend(const void* buf, int64_t bytes, int peer) override;
  Request IRecv(void* buf, int64_t bytes, int peer) override;
  void Wait(Request request) override;
  void Bcast(void* buf, int64_t bytes, int root) override;
  std::vector<std::string> Gather(const std::string& mine, int root) override;
  void BcastString(std::string* data, int root) override;
  void StartBitAnd(uint64_t* words, int n) override;
  bool TestBitAnd() override;
  bool NativeAllreduce(void*, int64_t, DataType, ReduceOp) override { return false; }

 private:
  struct PendingRecv {
    void* buf;
    int64_t bytes;
    int peer;
  };
  std::shared_ptr<LocalWorld> world_;
  int rank_;
  std::map<Request, PendingRecv> recvs_;
  Request next_request_ = 0;
  // The outstanding bit-and: where the result goes, and contributions the
  // root has collected so far.
  uint64_t* bit_words_ = nullptr;
  int bit_count_ = 0;
  std::vector<std::string> bit_parts_;
  int bit_parts_seen_ = 0;
};

}  // namespace hvdmx

#endif  // HVDMX_LOCAL_COMM_H_
