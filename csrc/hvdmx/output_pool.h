// The memory of the NDArrays our collectives return.
//
// Note [Output pool]
// ~~~~~~~~~~~~~~~~~~
// `hvd.allgather(x)`, `hvd.broadcast(x, 0)`, `hvd.allreduce(x)` and the other
// out-of-place calls return a new NDArray on every call. Through MXNet's CPU
// storage each is a fresh malloc; from 128 KiB up glibc serves that with a
// fresh mapping (and a worker thread's heap gives its pages back on free),
// so every call pays the kernel to fault in and zero every page of its
// output: about 5 ms of a 64 MiB allgather's 16.5 here (docs/benchmarks.md,
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
#ifndef HVDMX_OUTPUT_POOL_H_
#define HVDMX_OUTPUT_POOL_H_

#include <cstdint>
#include <mutex>
#include <vector>

namespace hvdmx {

class OutputPool {
 public:
  // Outputs smaller than this come from MXNet: malloc serves them from its
  // heaps without new pages.
  static constexpr int64_t kMinBytes = 64 * 1024;

  static OutputPool& Get();

  // The block size that serves `bytes`: a page multiple, at most 1/8 more.
  static int64_t ClassBytes(int64_t bytes);

  // A block of ClassBytes(bytes), or nullptr when the limit is 0 (the pool
  // is off) or no block can be mapped.
  void* Take(int64_t bytes);
  // Returns a block from Take (of ClassBytes(bytes)) to the pool.
  void Give(void* block, int64_t bytes);
  // Bytes the pool may keep; 0 keeps none. Surplus blocks are unmapped now.
  void SetLimit(int64_t limit);

  struct Stats {
    int64_t limit = 0;
    int64_t kept_bytes = 0;  // in blocks waiting to be taken again
    int64_t kept_blocks = 0; // how many (filled in by stats())
    int64_t out_bytes = 0;   // in blocks an NDArray holds now
    int64_t reused = 0;      // Takes served by a kept block
    int64_t mapped = 0;      // Takes that mapped a new block
  };
  Stats stats();

 private:
  OutputPool() = default;
  struct Block {
    void* data;
    int64_t bytes;
  };
  void TrimLocked();

  std::mutex mu_;
  std::vector<Block> kept_;  // in the order they were given back
  Stats stats_;
};

}  // namespace hvdmx

#endif  // HVDMX_OUTPUT_POOL_H_
