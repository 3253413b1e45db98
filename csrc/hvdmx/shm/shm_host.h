// Shared memory among one host's ranks, as one rank holds it: the region
// (shm_region.h) and the three kinds of calls on it, each its own class:
// the allreduce and reduce-scatter (ShmAllreduce), the byte-moving
// collectives (ShmExchange) and the negotiation's control channel
// (ShmControl). CreateShmHost (shm_segment.h) builds one at hvd.init();
// the tests build them over plain memory.
//
// Threading: a ShmHost belongs to one rank; its calls are made by one
// thread at a time (the runtime's), and stats() may be read from any.
#ifndef HVDMX_SHM_HOST_H_
#define HVDMX_SHM_HOST_H_

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "shm/shm_allreduce.h"
#include "shm/shm_control.h"
#include "shm/shm_exchange.h"
#include "shm/shm_region.h"

namespace hvdmx {

class ShmHost {
 public:
  // The arguments of ShmRegion's, ShmAllreduce's and ShmExchange's
  // constructors. `cross` non-empty makes the allreduce hierarchical, and
  // then the byte-moving calls are not used.
  ShmHost(int rank, int size, std::vector<char*> regions, int64_t chunk_bytes,
          std::shared_ptr<void> owner, ShmAllreduce::CrossAllreduce cross = nullptr,
          int64_t direct_min_bytes = -1, StageStores stores = StageStores::kAuto,
          bool huge_pages = true)
      : region_(rank, size, std::move(regions), chunk_bytes, std::move(owner)),
        allreduce_(&region_, cross, stores),
        exchange_(&region_, !cross, direct_min_bytes, stores, huge_pages),
        control_(&region_) {}
  ShmHost(const ShmHost&) = delete;
  ShmHost& operator=(const ShmHost&) = delete;

  int rank() const { return region_.rank(); }
  int size() const { return region_.size(); }
  bool hierarchical() const { return allreduce_.hierarchical(); }

  ShmRegion& region() { return region_; }
  ShmAllreduce& allreduce() { return allreduce_; }
  ShmExchange& exchange() { return exchange_; }
  const ShmExchange& exchange() const { return exchange_; }
  ShmControl& control() { return control_; }

  // What the calls have done so far; any thread may call it.
  ShmStats stats() const {
    ShmStats s = region_.stats();
    s.collapsed_huge_pages = exchange_.collapsed_huge_pages();
    s.refused_huge_pages = exchange_.refused_huge_pages();
    return s;
  }
  StageStores stage_stores() const { return allreduce_.stage_stores(); }

  // Tells the peers that this rank will make no more calls (Note [A peer
  // that stops]). Idempotent; the destructor calls it too.
  void MarkStopped() { region_.MarkStopped(); }

 private:
  ShmRegion region_;  // first: the others use it
  ShmAllreduce allreduce_;
  ShmExchange exchange_;
  ShmControl control_;
};

}  // namespace hvdmx

#endif  // HVDMX_SHM_HOST_H_
