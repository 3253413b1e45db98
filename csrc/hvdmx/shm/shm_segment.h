// Memory shared by the ranks of one host, and the set-up of a ShmHost
// (shm_host.h) over it at hvd.init(), which the job's wiring decides on
// (job/shm_wiring.h).
//
// Note [Shared memory without MPI windows]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The job decides once which ranks share a host (Note [One host split] in
// job/host_split.h): MPI's MPI_COMM_TYPE_SHARED, or the host name in a job
// started without MPI. The
// memory itself is one POSIX shared-memory object (shm_open), not an MPI-3
// window (MPI_Win_allocate_shared): MPI_Win_free is collective and,
// in MPICH, waits for every rank (a rank freeing a window waited until its
// peer freed its own: docs/benchmark-notes.md, "Figures the code cites").
// A Runtime is destroyed when its last reference goes, which can be on
// different threads and at different times on different ranks (after a
// peer's shutdown, say, while this rank is in an MPI call of its own), so a
// waiting free could deadlock. munmap is local.
// Creation is collective and happens in hvd.init(), which is collective
// anyway. Rank 0 unlinks the name as soon as every rank has mapped it, so
// nothing is left in /dev/shm even if the job is killed.
//
// Threading: Create runs on the thread that calls init; the mapping is then
// used by the runtime's background thread.
#ifndef HVDMX_SHM_SEGMENT_H_
#define HVDMX_SHM_SEGMENT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "comm/group.h"
#include "config/env_config.h"
#include "shm/shm_host.h"

namespace hvdmx {

class ShmSegment {
 public:
  // Maps one region of `region_bytes` (a multiple of 4096) per rank of
  // `group`, zeroed and faulted in. Collective over `group`, whose ranks must
  // share a host. Returns null on every rank if any rank failed, with the
  // reason in *why.
  static std::shared_ptr<ShmSegment> Create(Group& group, int64_t region_bytes, std::string* why);
  ~ShmSegment();  // unmaps; local, not collective
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  char* region(int rank) const { return base_ + rank * region_bytes_; }

 private:
  ShmSegment(char* base, int64_t region_bytes, int64_t total)
      : base_(base), region_bytes_(region_bytes), total_(total) {}
  char* base_;
  int64_t region_bytes_;
  int64_t total_;
};

// Makes the allreduce hierarchical: the ring between hosts (job/shm_wiring.h).
using MakeCrossAllreduce = std::function<ShmAllreduce::CrossAllreduce()>;

// Shared memory among `local`, the ranks of this rank's host (shm_host.h),
// once the job has decided to have it (job/shm_wiring.h): the segment, and
// the probes of what the ranks may do to each other's memory (direct reads,
// writes into their outputs). `hierarchical`: the ranks of `group` span
// hosts of as many ranks each, and the allreduce runs `make_cross()`'s ring
// between them. Null on every rank when the memory cannot be had (logged).
// Collective over `group` (each rank passing its own host's `local`).
std::unique_ptr<ShmHost> CreateShmHost(Group& group, Group& local, const Config& config,
                                       bool hierarchical, const MakeCrossAllreduce& make_cross);

}  // namespace hvdmx

#endif  // HVDMX_SHM_SEGMENT_H_
