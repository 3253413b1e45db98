// The timeline: a Chrome trace (chrome://tracing, Perfetto) of what each
// tensor went through on this rank, written by a thread of its own.
//
// One row ("process" in the trace) per tensor name, with complete events
// named as in Horovod's timeline (Note [Timeline names] in executor.cc):
// NEGOTIATE_<OP> (submitted until every rank was ready), then the operation
// <OP> (ALLREDUCE, BROADCAST, ...) holding its steps: QUEUE (ready until its
// group started), MEMCPY_IN_FUSION_BUFFER, the collective under its
// algorithm's name (RING_ALLREDUCE, MPI_ALLREDUCE, RING_ALLGATHER, ...),
// MEMCPY_OUT_FUSION_BUFFER. The negotiation and the operation carry the
// dtype and shape. Rank 0 adds an
// instant event as each rank's request reaches it (slow path only: a cached
// round has no per-rank arrivals), and, with mark_cycles, one per round.
//
// Cost: recording is a relaxed atomic load when off; when on, the background
// thread appends small structs under a mutex and the writer thread formats
// and writes them every 100 ms. The file is valid JSON at every moment: each
// write replaces the closing "]" with the new events and a new "]", in one
// pwrite, so a job killed at any point leaves a file that parses.
//
// Threading: any thread may record; Start and Stop from one thread at a time.
#ifndef HVDMX_TIMELINE_H_
#define HVDMX_TIMELINE_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "base/common.h"

namespace hvdmx {

class Timeline {
 public:
  using Clock = std::chrono::steady_clock;

  ~Timeline() { Stop(); }

  // Starts writing to `path` (replacing the file); restarts if running.
  Status Start(const std::string& path, bool mark_cycles);
  // Writes what is buffered and closes the file. No-op when stopped.
  void Stop();
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }
  bool mark_cycles() const { return mark_cycles_.load(std::memory_order_relaxed); }

  // A phase of `tensor` from `start` to `end`; `args` is a JSON object body
  // ("\"dtype\": \"float32\"") or empty.
  void Phase(const std::string& tensor, const char* phase, Clock::time_point start,
             Clock::time_point end, std::string args = std::string());
  // An instant event on `tensor`'s row.
  void Mark(const std::string& tensor, std::string what, Clock::time_point at);
  // The start of a negotiation round, on a row of its own.
  void Cycle(Clock::time_point at);

 private:
  struct Event {
    std::string tensor;
    std::string what;
    std::string args;
    char kind;  // 'X' complete, 'i' instant
    int64_t ts_us;
    int64_t dur_us;
  };
  void Record(Event event);
  void WriterLoop();
  // Formats `events` (adding row names for new tensors) and writes them.
  void Write(std::vector<Event>& events);

  std::atomic<bool> enabled_{false};
  std::atomic<bool> mark_cycles_{false};
  Clock::time_point origin_;

  std::mutex mu_;
  std::condition_variable wake_;
  std::vector<Event> pending_;
  bool stop_ = false;
  std::thread writer_;

  // Writer thread only (and Start/Stop around it).
  int fd_ = -1;
  int64_t end_ = 0;  // offset of the closing "]"
  bool first_event_ = true;
  std::unordered_map<std::string, int> rows_;
};

// The process's timeline, shared by every runtime (every process set).
Timeline& ProcessTimeline();

}  // namespace hvdmx

#endif  // HVDMX_TIMELINE_H_
