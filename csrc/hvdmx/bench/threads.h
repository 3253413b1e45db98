// Ranks that are threads of one process: what they use in place of MPI's
// exchange and barrier. The scale harness (scale_harness.h) and the tests'
// in-process TCP comms (testing/testing_tcp_bindings.cc) are made of them.
#ifndef HVDMX_BENCH_THREADS_H_
#define HVDMX_BENCH_THREADS_H_

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace hvdmx {

// The address exchange of n threads (TcpComm::Exchange): each puts its
// string and waits for every other's. The last to arrive first calls
// `on_all` with every string, before any rank goes on to make its links.
class ThreadExchange {
 public:
  explicit ThreadExchange(int n, std::function<void(const std::vector<std::string>&)> on_all = {})
      : slots_(n), on_all_(std::move(on_all)) {}
  std::vector<std::string> operator()(int rank, const std::string& mine) {
    std::unique_lock<std::mutex> lock(mu_);
    slots_[rank] = mine;
    if (++arrived_ == static_cast<int>(slots_.size())) {
      if (on_all_) on_all_(slots_);
      done_ = true;
      cv_.notify_all();
    }
    cv_.wait(lock, [&] { return done_; });
    return slots_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::string> slots_;
  std::function<void(const std::vector<std::string>&)> on_all_;
  int arrived_ = 0;
  bool done_ = false;
};

// A reusable barrier of n threads. A thread that fails calls Abort, and
// every wait then throws instead of waiting for it; so does a wait longer
// than `timeout`.
class ThreadBarrier {
 public:
  ThreadBarrier(int n, std::chrono::seconds timeout) : n_(n), timeout_(timeout) {}
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    const int64_t generation = generation_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    if (!cv_.wait_for(lock, timeout_, [&] { return generation_ != generation || aborted_; })) {
      throw std::runtime_error("a thread rank did not reach the barrier within " +
                               std::to_string(timeout_.count()) + " s");
    }
    if (aborted_) throw std::runtime_error("another thread rank failed");
  }
  void Abort() {
    std::lock_guard<std::mutex> lock(mu_);
    aborted_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  const int n_;
  const std::chrono::seconds timeout_;
  int arrived_ = 0;
  int64_t generation_ = 0;
  bool aborted_ = false;
};

}  // namespace hvdmx

#endif  // HVDMX_BENCH_THREADS_H_
