// Backing memory that peers read with cross-memory attach by huge pages.
//
// Note [Huge pages under what peers read]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A peer reading this process's memory with process_vm_readv makes the
// kernel pin every page it reads. On 4 KiB pages that costs about as much
// as the copy, and an MPI_Alltoall from MXNet's arrays (4 KiB pages) was
// much slower than from numpy's (which asks for transparent huge pages from
// 4 MiB up) until madvise(MADV_COLLAPSE) had put them on huge pages
// (docs/benchmark-notes.md, "The targets, measured again", and "Figures
// the code cites").
// MXNet never asks for huge pages, and its arrays are allocated once and
// reused (its storage pool, a model's parameters and gradients), so before
// a rank publishes a buffer for its peers to read directly it collapses
// the whole 2 MiB pages inside it, once per page: the first call pays a
// fraction of a millisecond per MiB, later ones a set lookup per page. Collapsing keeps
// the bytes; it may fail (no memory for a huge page, a kernel before 6.1,
// transparent huge pages off), which only leaves the pages as they were.
// A page that was unmapped and mapped again stays in the set and is not
// collapsed again: slower reads, never wrong ones.
//
// hvdmx collapses what peers read in two places: the streams of direct
// exchanges (ShmExchange::ExchangeDirect), and the buffers it hands to MPI
// when a peer of the communicator is on this host (Executor): MPICH moves
// large messages between ranks of one host with the same cross-memory
// attach, so the peer's reads pin these pages too. HVDMX_HUGE_PAGES=0 turns
// both off.
//
// Threading: one thread at a time calls Collapse; any thread may read the
// counts.
#ifndef HVDMX_HUGE_PAGES_H_
#define HVDMX_HUGE_PAGES_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <unordered_set>

namespace hvdmx {

class HugePageCollapser {
 public:
  static constexpr int64_t kHugePageBytes = int64_t{2} << 20;
  // Pages remembered before the set starts again (2 TiB of them).
  static constexpr size_t kMaxPages = size_t{1} << 20;

  // An `enabled` of false makes Collapse do nothing.
  explicit HugePageCollapser(bool enabled = true) : enabled_(enabled) {}

  bool enabled() const { return enabled_; }
  // Collapses the whole huge pages inside [data, data + bytes) not asked
  // about before.
  void Collapse(const void* data, int64_t bytes);
  // Huge pages collapsed so far, and those the kernel refused.
  int64_t collapsed() const { return collapsed_.load(std::memory_order_relaxed); }
  int64_t refused() const { return refused_.load(std::memory_order_relaxed); }

 private:
  const bool enabled_;
  std::unordered_set<uintptr_t> seen_;  // pages asked about
  std::atomic<int64_t> collapsed_{0};
  std::atomic<int64_t> refused_{0};
};

}  // namespace hvdmx

#endif  // HVDMX_HUGE_PAGES_H_
