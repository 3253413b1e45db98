#include "shm/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "algorithms/ring.h"
#include "base/logging.h"
#include "comm/mpi_comm.h"
#include "platform/output_pool.h"

namespace hvdmx {
namespace {

std::string ErrnoText(const std::string& what, int err) { return what + ": " + std::strerror(err); }

// Creates and sizes a new shared-memory object with a name no other object
// has. Returns the fd, or -1 with *why set.
int CreateObject(int64_t bytes, std::string* name, std::string* why) {
  static std::atomic<int> counter{0};
  for (int attempt = 0; attempt < 100; ++attempt) {
    *name = "/hvdmx." + std::to_string(getpid()) + "." + std::to_string(counter++);
    const int fd = shm_open(name->c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0 && errno == EEXIST) continue;
    if (fd < 0) {
      *why = ErrnoText("shm_open(" + *name + ")", errno);
      return -1;
    }
    // posix_fallocate reserves the pages now: a full /dev/shm fails here
    // rather than with SIGBUS at the first touch.
    int err = ftruncate(fd, bytes) == 0 ? posix_fallocate(fd, 0, bytes) : errno;
    if (err != 0) {
      *why = ErrnoText("reserving " + std::to_string(bytes) + " bytes in /dev/shm", err);
      close(fd);
      shm_unlink(name->c_str());
      return -1;
    }
    return fd;
  }
  *why = "no free shared-memory object name";
  return -1;
}

}  // namespace

std::shared_ptr<ShmSegment> ShmSegment::Create(MPI_Comm comm, int64_t region_bytes,
                                               std::string* why) {
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  const int64_t total = region_bytes * size;

  // Rank 0 creates the object and sends its name ("" when it failed).
  std::string name;
  int fd = -1;
  if (rank == 0) {
    fd = CreateObject(total, &name, why);
    if (fd < 0) name.clear();
  }
  char name_buf[64] = {};
  std::strncpy(name_buf, name.c_str(), sizeof(name_buf) - 1);
  MPI_Bcast(name_buf, sizeof(name_buf), MPI_CHAR, 0, comm);
  name = name_buf;

  void* base = MAP_FAILED;
  if (!name.empty()) {
    if (rank != 0) fd = shm_open(name.c_str(), O_RDWR, 0);
    if (fd < 0) {
      *why = ErrnoText("shm_open(" + name + ") on rank " + std::to_string(rank), errno);
    } else {
      // MAP_POPULATE faults every page in now, so no collective page-faults.
      base = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
      if (base == MAP_FAILED) *why = ErrnoText("mmap on rank " + std::to_string(rank), errno);
      close(fd);
    }
  } else if (rank != 0) {
    *why = "rank 0 could not create the shared memory";
  }
  int mapped = base != MAP_FAILED ? 1 : 0;
  int all_mapped = 0;
  MPI_Allreduce(&mapped, &all_mapped, 1, MPI_INT, MPI_MIN, comm);
  if (rank == 0 && !name.empty()) shm_unlink(name.c_str());  // every rank has opened it
  if (!all_mapped) {
    if (mapped) munmap(base, total);
    if (why->empty()) *why = "another rank could not map the shared memory";
    return nullptr;
  }
  return std::shared_ptr<ShmSegment>(new ShmSegment(static_cast<char*>(base), region_bytes, total));
}

ShmSegment::~ShmSegment() { munmap(base_, total_); }

namespace {

// The ranks of `comm` on this rank's host (or pretend host, see
// Config::testing_ranks_per_host), in comm's order.
MPI_Comm SplitByHost(MPI_Comm comm, const Config& config) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm local;
  if (config.testing_ranks_per_host > 0) {
    MPI_Comm_split(comm, static_cast<int>(rank / config.testing_ranks_per_host), rank, &local);
  } else {
    MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &local);
  }
  return local;
}

// The ring between hosts for a hierarchical allreduce: over the ranks of
// `comm` with this rank's local rank.
ShmAllreduce::CrossAllreduce RingAcrossHosts(MPI_Comm comm, int local_rank, const Config& config) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm cross;
  MPI_Comm_split(comm, local_rank, rank, &cross);
  const bool busy = config.transport == Transport::kTcp && HostRanksOutnumberCpus(comm);
  std::shared_ptr<Comm> ring = CommOver(cross, config, busy);
  MPI_Comm_free(&cross);
  auto scratch = std::make_shared<RingScratch>();
  const int64_t segment_bytes = config.ring_segment_bytes;
  const bool wide_partials = config.half_partials_wide;
  return [ring, scratch, segment_bytes, wide_partials](
             void* buf, float* wide, int64_t count, DataType dtype, ReduceOp op, double postscale) {
    RingCrossAllreduce(*ring, buf, wide, count, dtype, op, postscale, wide_partials, segment_bytes,
                       scratch.get());
  };
}

// Whether every rank of `local` can read every other's memory with
// cross-memory attach (Note [Reading peers' buffers directly] in
// shm_exchange_direct.cc): each tries a word of each peer. Collective over `comm`
// (every rank of the job agrees). On failure *why says why, on the rank
// that failed.
bool CrossMemoryAttachWorksOnHost(MPI_Comm comm, MPI_Comm local, std::string* why) {
  static const uint64_t kProbe = 0x6876646d782d636dULL;
  // Peers write kProbe here, all the same bytes; nothing reads it.
  static uint64_t written_by_peers = 0;
  int rank = 0, size = 1;
  MPI_Comm_rank(local, &rank);
  MPI_Comm_size(local, &size);
  const int64_t mine[3] = {getpid(), static_cast<int64_t>(reinterpret_cast<uintptr_t>(&kProbe)),
                           static_cast<int64_t>(reinterpret_cast<uintptr_t>(&written_by_peers))};
  std::vector<int64_t> all(3 * static_cast<size_t>(size));
  MPI_Allgather(mine, 3, MPI_INT64_T, all.data(), 3, MPI_INT64_T, local);
  int ok = 1;
  for (int j = 0; j < size && ok; ++j) {
    const void* address = reinterpret_cast<const void*>(static_cast<uintptr_t>(all[3 * j + 1]));
    void* writable = reinterpret_cast<void*>(static_cast<uintptr_t>(all[3 * j + 2]));
    if (j != rank && !ShmExchange::CrossMemoryAttachWorks(all[3 * j], address, &kProbe, writable,
                                                          sizeof(kProbe), why)) {
      *why = "local rank " + std::to_string(rank) + " cannot read or write local rank " +
             std::to_string(j) + "'s memory: " + *why;
      ok = 0;
    }
  }
  MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, comm);
  if (!ok && why->empty()) *why = "a rank on another host or of this one cannot";
  return ok != 0;
}

// Where direct exchanges start: config.shm_direct_min_bytes (kShmDirectAuto
// included), or -1 (never) on every rank when some rank cannot read its
// peers' memory. Collective over `comm` unless it is -1.
int64_t DirectMinBytes(MPI_Comm comm, MPI_Comm local, const Config& config) {
  static_assert(kShmDirectAuto == ShmExchange::kDirectAuto, "one value for auto");
  if (config.shm_direct_min_bytes == -1) return -1;
  std::string why;
  if (!CrossMemoryAttachWorksOnHost(comm, local, &why)) {
    if (config.shm_direct_min_bytes == kShmDirectAuto) {
      HVDMX_LOG(kDebug) << "shared memory moves bytes through its stages only: " << why;
    } else {
      HVDMX_LOG(kWarning) << "HVDMX_SHM_DIRECT_MIN_BYTES=" << config.shm_direct_min_bytes
                          << " ignored, shared memory moves bytes through its stages: " << why;
    }
    return -1;
  }
  return config.shm_direct_min_bytes;
}

// Every local rank's shared output file (Note [Outputs in shared memory] in
// output_pool.h) as mapped in this process: bases[j] is local rank j's.
struct OutputFiles {
  std::vector<char*> bases;
  std::vector<void*> mapped;  // the peers' files, unmapped with this object
  ~OutputFiles() {
    for (void* p : mapped) munmap(p, static_cast<size_t>(OutputPool::kArenaBytes));
  }
};

// Makes this rank's output pool cut new blocks from its shared file and
// maps every peer's, opened through /proc/<pid>/fd (which needs the same
// user). Collective over `comm`: every rank of the job gets the files, or
// none does (nullptr, with *why on the rank that failed).
std::shared_ptr<OutputFiles> MapOutputFiles(MPI_Comm comm, MPI_Comm local, const Config& config,
                                            std::string* why) {
  int rank = 0, size = 1;
  MPI_Comm_rank(local, &rank);
  MPI_Comm_size(local, &size);
  int fd = -1;
  if (config.output_pool_bytes == 0) {
    *why = "HVDMX_OUTPUT_POOL_BYTES=0 keeps outputs out of the shared file";
  } else {
    fd = OutputPool::Get().ShareFromNow(why);
  }
  const int64_t mine[2] = {fd >= 0 ? static_cast<int64_t>(getpid()) : -1, fd};
  std::vector<int64_t> all(2 * static_cast<size_t>(size));
  MPI_Allgather(mine, 2, MPI_INT64_T, all.data(), 2, MPI_INT64_T, local);
  auto files = std::make_shared<OutputFiles>();
  int ok = fd >= 0 ? 1 : 0;
  for (int j = 0; j < size && ok; ++j) {
    if (j == rank) {
      files->bases.push_back(OutputPool::Get().arena());
      continue;
    }
    if (all[2 * j] < 0) {
      *why = "local rank " + std::to_string(j) + " has no shared output file";
      ok = 0;
      break;
    }
    const std::string path =
        "/proc/" + std::to_string(all[2 * j]) + "/fd/" + std::to_string(all[2 * j + 1]);
    const int peer_fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (peer_fd < 0) {
      *why = ErrnoText("opening local rank " + std::to_string(j) + "'s output file " + path, errno);
      ok = 0;
      break;
    }
    void* base = mmap(nullptr, static_cast<size_t>(OutputPool::kArenaBytes), PROT_READ | PROT_WRITE,
                      MAP_SHARED | MAP_NORESERVE, peer_fd, 0);
    const int err = errno;
    close(peer_fd);
    if (base == MAP_FAILED) {
      *why = ErrnoText("mapping local rank " + std::to_string(j) + "'s output file", err);
      ok = 0;
      break;
    }
    files->mapped.push_back(base);
    files->bases.push_back(static_cast<char*>(base));
    if (*static_cast<const int64_t*>(base) != all[2 * j]) {
      *why = path + " is not local rank " + std::to_string(j) + "'s output file";
      ok = 0;
    }
  }
  MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, comm);
  if (!ok) {
    if (why->empty()) *why = "another rank could not map its peers' output files";
    return nullptr;
  }
  return files;
}

}  // namespace

std::unique_ptr<ShmHost> CreateNodeShm(MPI_Comm comm, const Config& config) {
  if (config.allreduce_algo != AllreduceAlgo::kAuto &&
      config.allreduce_algo != AllreduceAlgo::kShm) {
    return nullptr;
  }
  int size = 1;
  MPI_Comm_size(comm, &size);
  MPI_Comm local = SplitByHost(comm, config);
  int local_rank = 0, local_size = 1;
  MPI_Comm_rank(local, &local_rank);
  MPI_Comm_size(local, &local_size);
  // Hierarchical needs every host to have the same number of ranks.
  int sizes[2] = {-local_size, local_size};  // -min, max
  MPI_Allreduce(MPI_IN_PLACE, sizes, 2, MPI_INT, MPI_MAX, comm);
  const bool one_host = local_size == size;
  // Unset, it is hierarchical wherever the hosts allow: measured across test
  // hosts at 2 x 2 ranks, the ResNet-50 gradient set took 152 ms against the
  // flat ring's 232 (docs/benchmarks.md, "Many hosts").
  const bool wanted = config.hierarchical_allreduce || !config.hierarchical_allreduce_set;
  const bool hierarchical = !one_host && wanted && -sizes[0] == sizes[1] && local_size > 1;
  if (size == 1 || (!one_host && !hierarchical)) {
    if (config.hierarchical_allreduce && !one_host) {
      HVDMX_LOG(kWarning) << "HVDMX_HIERARCHICAL_ALLREDUCE=1 ignored, the ring is used: it needs "
                          << "the same number of ranks, more than one, on every host (here "
                          << -sizes[0] << " to " << sizes[1] << ")";
    }
    HVDMX_LOG(kDebug) << "shared-memory allreduce off: " << size << " rank(s), " << local_size
                      << " on this host";
    MPI_Comm_free(&local);
    return nullptr;
  }
  const int64_t region_bytes = ShmRegion::RegionBytes(config.shm_chunk_bytes);
  std::string why;
  // Direct reads are for one host's byte moves: no probe when hierarchical.
  const int64_t direct_min_bytes = hierarchical ? -1 : DirectMinBytes(comm, local, config);
  std::shared_ptr<ShmSegment> segment = ShmSegment::Create(local, region_bytes, &why);
  std::shared_ptr<OutputFiles> files;
  // Writing into peers' outputs is for one host's byte moves too.
  if (config.shm_push && !hierarchical) {
    std::string push_why;
    files = MapOutputFiles(comm, local, config, &push_why);
    if (files == nullptr) {
      HVDMX_LOG(kDebug) << "allgathers and alltoalls do not write into peers' outputs: "
                        << push_why;
    }
  }
  MPI_Comm_free(&local);
  // Every rank must agree, across hosts too.
  int ok = segment != nullptr ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, comm);
  if (!ok) {
    HVDMX_LOG(kWarning) << "shared-memory allreduce off, the ring is used instead: "
                        << (why.empty() ? "another host could not map its memory" : why);
    return nullptr;
  }
  std::vector<char*> regions;
  for (int j = 0; j < local_size; ++j) regions.push_back(segment->region(j));
  ShmAllreduce::CrossAllreduce cross;
  if (hierarchical) cross = RingAcrossHosts(comm, local_rank, config);
  HVDMX_LOG(kDebug) << "shared-memory allreduce on: " << local_size << " ranks on this host"
                    << (hierarchical ? ", the ring between hosts" : "") << ", " << region_bytes
                    << " bytes per rank, direct reads "
                    << (direct_min_bytes == kShmDirectAuto ? std::string("auto")
                        : direct_min_bytes < 0
                            ? std::string("never")
                            : "from " + std::to_string(direct_min_bytes) + " bytes")
                    << (files ? ", writes into peers' outputs" : "");
  auto owner =
      std::make_shared<std::pair<std::shared_ptr<ShmSegment>, std::shared_ptr<OutputFiles>>>(
          segment, files);
  auto shm = std::make_unique<ShmHost>(
      local_rank, local_size, std::move(regions), config.shm_chunk_bytes, std::move(owner),
      std::move(cross), direct_min_bytes, config.shm_streaming_stores, config.huge_pages);
  if (files)
    shm->exchange().WriteIntoPeers(files->bases, OutputPool::kArenaBytes, OutputPool::kMinBytes);
  return shm;
}

}  // namespace hvdmx
