#include "shm/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "base/logging.h"
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

std::shared_ptr<ShmSegment> ShmSegment::Create(Group& group, int64_t region_bytes,
                                               std::string* why) {
  const int rank = group.rank(), size = group.size();
  const int64_t total = region_bytes * size;

  // Rank 0 creates the object and sends its name ("" when it failed).
  std::string name;
  int fd = -1;
  if (rank == 0) {
    fd = CreateObject(total, &name, why);
    if (fd < 0) name.clear();
  }
  name = GroupBcast(group, name, 0);

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
  const int mapped = base != MAP_FAILED ? 1 : 0;
  const int64_t all_mapped = GroupMin(group, mapped);
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

// Whether every rank of `local` can read every other's memory with
// cross-memory attach (Note [Reading peers' buffers directly] in
// shm_exchange_direct.cc): each tries a word of each peer. Collective over `group`
// (every rank of the job agrees). On failure *why says why, on the rank
// that failed.
bool CrossMemoryAttachWorksOnHost(Group& group, Group& local, std::string* why) {
  static const uint64_t kProbe = 0x6876646d782d636dULL;
  // Peers write kProbe here, all the same bytes; nothing reads it.
  static uint64_t written_by_peers = 0;
  const int rank = local.rank(), size = local.size();
  const std::vector<int64_t> all =
      AllgatherInts(local, {getpid(), static_cast<int64_t>(reinterpret_cast<uintptr_t>(&kProbe)),
                            static_cast<int64_t>(reinterpret_cast<uintptr_t>(&written_by_peers))});
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
  ok = static_cast<int>(GroupMin(group, ok));
  if (!ok && why->empty()) *why = "a rank on another host or of this one cannot";
  return ok != 0;
}

// Where direct exchanges start: config.shm_direct_min_bytes (kShmDirectAuto
// included), or -1 (never) on every rank when some rank cannot read its
// peers' memory. Collective over `group` unless it is -1.
int64_t DirectMinBytes(Group& group, Group& local, const Config& config) {
  static_assert(kShmDirectAuto == ShmExchange::kDirectAuto, "one value for auto");
  if (config.shm_direct_min_bytes == -1) return -1;
  std::string why;
  if (!CrossMemoryAttachWorksOnHost(group, local, &why)) {
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
// user). Collective over `group`: every rank of the job gets the files, or
// none does (nullptr, with *why on the rank that failed).
std::shared_ptr<OutputFiles> MapOutputFiles(Group& group, Group& local, const Config& config,
                                            std::string* why) {
  const int rank = local.rank(), size = local.size();
  int fd = -1;
  if (config.output_pool_bytes == 0) {
    *why = "HVDMX_OUTPUT_POOL_BYTES=0 keeps outputs out of the shared file";
  } else {
    fd = OutputPool::Get().ShareFromNow(why);
  }
  const std::vector<int64_t> all =
      AllgatherInts(local, {fd >= 0 ? static_cast<int64_t>(getpid()) : -1, fd});
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
  ok = static_cast<int>(GroupMin(group, ok));
  if (!ok) {
    if (why->empty()) *why = "another rank could not map its peers' output files";
    return nullptr;
  }
  return files;
}

}  // namespace

std::unique_ptr<ShmHost> CreateShmHost(Group& group, Group& local, const Config& config,
                                       bool hierarchical, const MakeCrossAllreduce& make_cross) {
  const int local_rank = local.rank(), local_size = local.size();
  const int64_t region_bytes = ShmRegion::RegionBytes(config.shm_chunk_bytes);
  std::string why;
  // Direct reads are for one host's byte moves: no probe when hierarchical.
  const int64_t direct_min_bytes = hierarchical ? -1 : DirectMinBytes(group, local, config);
  std::shared_ptr<ShmSegment> segment = ShmSegment::Create(local, region_bytes, &why);
  std::shared_ptr<OutputFiles> files;
  // Writing into peers' outputs is for one host's byte moves too.
  if (config.shm_push && !hierarchical) {
    std::string push_why;
    files = MapOutputFiles(group, local, config, &push_why);
    if (files == nullptr) {
      HVDMX_LOG(kDebug) << "allgathers and alltoalls do not write into peers' outputs: "
                        << push_why;
    }
  }
  // Every rank must agree, across hosts too.
  const int64_t ok = GroupMin(group, segment != nullptr ? 1 : 0);
  if (!ok) {
    HVDMX_LOG(kWarning) << "shared-memory allreduce off, the ring is used instead: "
                        << (why.empty() ? "another host could not map its memory" : why);
    return nullptr;
  }
  std::vector<char*> regions;
  for (int j = 0; j < local_size; ++j) regions.push_back(segment->region(j));
  ShmAllreduce::CrossAllreduce cross;
  if (hierarchical) cross = make_cross();
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
