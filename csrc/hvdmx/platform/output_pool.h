// The memory of the NDArrays our collectives return.
//
// Note [Output pool]
// ~~~~~~~~~~~~~~~~~~
// `hvd.allgather(x)`, `hvd.broadcast(x, 0)`, `hvd.allreduce(x)` and the other
// out-of-place calls return a new NDArray on every call. Through MXNet's CPU
// storage each is a fresh malloc; from 128 KiB up glibc serves that with a
// fresh mapping (and a worker thread's heap gives its pages back on free),
// so every call pays the kernel to fault in and zero every page of its
// output: a third of a large allgather's time (docs/benchmark-notes.md,
// "Outputs from a pool"). Users run with default malloc, so the collectives' outputs
// come from this pool instead: page-aligned blocks in size classes (at most
// 1/8 larger than asked for), kept once touched and handed out again, most
// recently returned first, when an output of the same class is asked for.
//
// An output is an NDArray made by MXNDArrayFromDLPackEx over a block; MXNet
// calls the DLPack deleter when the last NDArray sharing the memory (views
// and slices included) is destroyed, and every op that reads or writes an
// NDArray holds a reference until it has run, as our own ops do (Note
// [Engine completion]). The deleter gives the block back. Blocks are kept
// up to `limit` bytes in all (HVDMX_OUTPUT_POOL_BYTES); a block given back
// beyond it pushes out the longest-kept ones, which are unmapped.
//
// The pool outlives hvd.shutdown() and the interpreter's own teardown (an
// NDArray may be freed after both), so it is never destroyed. Any thread may
// call any method.
//
// Note [Outputs in shared memory]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Once ShareFromNow() has run (hvd.init() calls it when shared memory moves
// this host's bytes), new blocks are cut from one shared-memory file (a
// memfd of kArenaBytes, sparse until used) instead of fresh private
// mappings. The ranks of the host map each other's file, so an allgather or
// alltoall can write each rank's rows straight into its peers' outputs: one
// copy per byte, where the stages make two (Note [Writing into peers'
// outputs] in shm_exchange_push.cc). A block cut from the file keeps its place
// in it; trimmed, its pages go back to the kernel (a hole is punched) and
// its place waits for a block of the same class. When the file is full,
// blocks are private mappings again. A process that forks shares the
// file's pages with its child instead of copying them on write.
#ifndef HVDMX_OUTPUT_POOL_H_
#define HVDMX_OUTPUT_POOL_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace hvdmx {

class OutputPool {
 public:
  // Outputs smaller than this come from MXNet: malloc serves them from its
  // heaps without new pages.
  static constexpr int64_t kMinBytes = 64 * 1024;
  // The limit until hvd.init() sets one (HVDMX_OUTPUT_POOL_BYTES's default).
  static constexpr int64_t kDefaultLimitBytes = 256 * 1024 * 1024;

  static OutputPool& Get();

  // The block size that serves `bytes`: a page multiple, at most 1/8 more.
  static int64_t ClassBytes(int64_t bytes);

  // A block of ClassBytes(bytes), or nullptr when the limit is 0 (the pool
  // is off) or no block can be mapped.
  void* Take(int64_t bytes);
  // Returns a block from Take (of ClassBytes(bytes)) to the pool.
  void Give(void* block, int64_t bytes);
  // Bytes the pool may keep; 0 keeps none. Surplus blocks are unmapped (or,
  // in the shared file, their pages given back) now.
  void SetLimit(int64_t limit);

  // Address space of the shared file: blocks are cut from it until it is full.
  static constexpr int64_t kArenaBytes = int64_t{64} << 30;
  static constexpr int64_t kPageBytes = 4096;
  static constexpr int64_t kHugeBytes = int64_t{2} << 20;
  // Cuts new blocks from a shared-memory file from now on (see Note [Outputs
  // in shared memory]); once per process, later calls return the same.
  // Returns the file's descriptor, or -1 with *why when it cannot be made.
  int ShareFromNow(std::string* why);
  // Where the shared file is mapped in this process (nullptr before
  // ShareFromNow succeeds); its first 8 bytes hold this process's pid.
  char* arena() const { return arena_.load(std::memory_order_acquire); }
  // Whether [data, data + bytes) lies in the shared file; *offset is then
  // its distance from arena().
  bool InArena(const void* data, int64_t bytes, int64_t* offset) const;

  struct Stats {
    int64_t limit = 0;
    int64_t kept_bytes = 0;   // in blocks waiting to be taken again
    int64_t kept_blocks = 0;  // how many (filled in by stats())
    int64_t out_bytes = 0;    // in blocks an NDArray holds now
    int64_t reused = 0;       // Takes served by a kept block
    int64_t mapped = 0;       // Takes that mapped or cut a new block
    int64_t arena_used = 0;   // bytes of the shared file cut into blocks
  };
  Stats stats();

 private:
  OutputPool() = default;
  struct Block {
    void* data;
    int64_t bytes;
  };
  void TrimLocked();
  // A new block of `size` from the shared file, or nullptr when there is
  // none or it is full.
  void* CutLocked(int64_t size);
  // Whether this process is a fork of the one that made the shared file.
  bool Forked() const;

  std::mutex mu_;
  std::vector<Block> kept_;   // in the order they were given back
  std::vector<Block> holes_;  // places in the shared file with no pages
  Stats stats_;
  int arena_fd_ = -1;
  pid_t arena_pid_ = -1;  // the process that made the shared file
  std::atomic<char*> arena_{nullptr};
};

}  // namespace hvdmx

#endif  // HVDMX_OUTPUT_POOL_H_
