// The copy floor under a 2-rank broadcast on one host, without hvdmx's
// negotiation, engine op or Python: what the bytes alone cost, timed three
// ways in one run so that all three see the same phase of the machine.
//
//   local   one process copies the buffer into another of its own (memcpy):
//           no second core involved.
//   stages  hvdmx's staged broadcast, bare: the root copies each 256 KiB
//           chunk into one of 4 shared stages (half a page away from where it
//           sits in its buffer, as Note [Where a chunk sits in its stage]
//           has it) and publishes it; the peer copies it out into its buffer
//           and frees the stage. Both sides use glibc's memcpy, as hvdmx does.
//           "root busy" and "peer busy" are the time each spends copying.
//   readv   MPICH's way for large messages: the peer copies the root's buffer
//           into its own with one process_vm_readv (cross-memory attach),
//           on 4 KiB pages (as MXNet's arrays are), then on buffers advised
//           and aligned as transparent huge pages (as numpy's large arrays
//           partly are: numpy advises them, but malloc aligns them to 16
//           bytes, so only the 2 MiB pages wholly inside can be huge).
//
// Build and run (no MPI needed; the two processes come from fork):
//
//   cc -O2 -o /tmp/stage_floor benchmarks/stage_floor.c && /tmp/stage_floor
//
// Prints one row per size: microseconds per broadcast, mean over --iters
// after a warm-up. Compare with `python -m hvdmx.bench broadcast` run right
// before or after it (docs/benchmark-notes.md, "The copy floor under a 4 MiB
// broadcast (25 November, at e6a4520)").
#define _GNU_SOURCE
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum { kStages = 4, kPage = 4096, kWarmup = 30 };
static const size_t kChunk = 256 << 10, kHuge = 2 << 20;

// Shared between the two processes: counters on their own cache lines, and
// the stages.
struct Shared {
  _Alignas(128) _Atomic uint64_t copied;  // chunks the root has published
  _Alignas(128) _Atomic uint64_t done;    // chunks the peer has copied out
  _Alignas(128) _Atomic uint64_t ready;   // readv round: the root's buffer is set
  _Alignas(128) _Atomic uint64_t read;    // readv round: the peer has read it
  uintptr_t root_buffer;                  // readv round: where to read
  pid_t root_pid, peer_pid;
  _Atomic int failed;                     // either side has failed: both stop
  double peer_busy;                       // seconds per broadcast, for the root to print
};

static struct Shared* sh;

// Reports `what`, tells the other process, and exits 1.
static void Fail(const char* what) {
  fprintf(stderr, "stage_floor: %s\n", what);
  atomic_store(&sh->failed, 1);
  exit(1);
}

static double Now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

// Waits until *counter >= at_least; exits 1 if the other process failed or
// is gone, so that neither ever waits forever.
static void Spin(_Atomic uint64_t* counter, uint64_t at_least) {
  for (uint64_t spins = 1; atomic_load_explicit(counter, memory_order_acquire) < at_least;
       ++spins) {
    __builtin_ia32_pause();
    if (spins % (1 << 20) != 0) continue;
    const pid_t other = getpid() == sh->root_pid ? sh->peer_pid : sh->root_pid;
    if (atomic_load(&sh->failed) || (other != 0 && kill(other, 0) != 0)) {
      fprintf(stderr, "stage_floor: the other process failed or exited; stopping\n");
      exit(1);
    }
  }
}

static void Pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  sched_setaffinity(0, sizeof set, &set);  // best effort: fine if it fails
}

// One process's part in `iters` staged broadcasts of `bytes`; returns the
// seconds per broadcast and sets *busy to those it spent copying.
static double Stages(char* stages, char* buffer, size_t bytes, int root, int iters,
                     uint64_t* seq, double* busy) {
  const size_t chunks = (bytes + kChunk - 1) / kChunk;
  double start = 0, copying = 0;
  for (int it = 0; it < kWarmup + iters; ++it) {
    if (it == kWarmup) start = Now(), copying = 0;
    for (size_t k = 0; k < chunks; ++k, ++*seq) {
      const size_t n = k + 1 == chunks ? bytes - k * kChunk : kChunk;
      char* stage = stages + (*seq % kStages) * (kChunk + kPage) + kPage / 2;
      if (root) {
        if (*seq >= kStages) Spin(&sh->done, *seq - kStages + 1);
        const double t = Now();
        memcpy(stage, buffer + k * kChunk, n);
        copying += Now() - t;
        atomic_store_explicit(&sh->copied, *seq + 1, memory_order_release);
      } else {
        Spin(&sh->copied, *seq + 1);
        const double t = Now();
        memcpy(buffer + k * kChunk, stage, n);
        copying += Now() - t;
        atomic_store_explicit(&sh->done, *seq + 1, memory_order_release);
      }
    }
    // The root's buffer is the caller's again only once the peer is done.
    if (root) Spin(&sh->done, *seq);
  }
  *busy = copying / iters;
  return (Now() - start) / iters;
}

// One process's part in `iters` broadcasts by process_vm_readv.
static double Readv(char* buffer, size_t bytes, int root, int iters, uint64_t* round) {
  double start = 0;
  for (int it = 0; it < kWarmup + iters; ++it, ++*round) {
    if (it == kWarmup) start = Now();
    if (root) {
      atomic_store_explicit(&sh->ready, *round + 1, memory_order_release);
      Spin(&sh->read, *round + 1);
    } else {
      Spin(&sh->ready, *round + 1);
      struct iovec local = {buffer, bytes};
      struct iovec remote = {(void*)sh->root_buffer, bytes};
      if (process_vm_readv(sh->root_pid, &local, 1, &remote, 1, 0) != (ssize_t)bytes) {
        Fail("process_vm_readv failed (it needs permission to ptrace the root)");
      }
      atomic_store_explicit(&sh->read, *round + 1, memory_order_release);
    }
  }
  return (Now() - start) / iters;
}

static double Local(char* from, char* to, size_t bytes, int iters) {
  double start = 0;
  for (int it = 0; it < kWarmup + iters; ++it) {
    if (it == kWarmup) start = Now();
    memcpy(to, from, bytes);
    __asm__ volatile("" : : "r"(to) : "memory");
  }
  return (Now() - start) / iters;
}

static void Usage(const char* argv0) {
  fprintf(stderr, "usage: %s [--min-bytes B] [--max-bytes B] [--iters N]\n"
                  "  sizes from --min-bytes (default 1048576) to --max-bytes (default 67108864)"
                  " by factors of 4;\n  --iters broadcasts per size and way (default 200)\n",
          argv0);
  exit(2);
}

int main(int argc, char** argv) {
  size_t min_bytes = 1 << 20, max_bytes = 64 << 20;
  int iters = 200;
  for (int i = 1; i < argc; ++i) {
    if (i + 1 >= argc) Usage(argv[0]);
    char* end;
    const long long v = strtoll(argv[i + 1], &end, 0);
    if (*end != '\0' || v < 1) {
      fprintf(stderr, "%s: %s must be a positive integer (got %s)\n", argv[0], argv[i],
              argv[i + 1]);
      return 2;
    }
    if (!strcmp(argv[i], "--min-bytes")) min_bytes = (size_t)v;
    else if (!strcmp(argv[i], "--max-bytes")) max_bytes = (size_t)v;
    else if (!strcmp(argv[i], "--iters")) iters = v > 1000000 ? 1000001 : (int)v;
    else Usage(argv[0]);
    ++i;
  }
  if (min_bytes > max_bytes) {
    fprintf(stderr, "%s: want --min-bytes <= --max-bytes (got %zu > %zu)\n", argv[0],
            min_bytes, max_bytes);
    return 2;
  }
  if (iters > 1000000) {
    fprintf(stderr, "%s: --iters must be at most 1000000 (got more)\n", argv[0]);
    return 2;
  }
  sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  char* stages = mmap(NULL, kStages * (kChunk + kPage), PROT_READ | PROT_WRITE,
                      MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (sh == MAP_FAILED || stages == MAP_FAILED) return perror("stage_floor: mmap"), 1;
  memset(stages, 0, kStages * (kChunk + kPage));
  sh->root_pid = getpid();
  fflush(stdout);
  const pid_t child = fork();
  if (child < 0) return perror("stage_floor: fork"), 1;
  const int root = child != 0;
  if (root) sh->peer_pid = child;
  Pin(root ? 0 : 1);
  if (root) {
    printf("# bare 2-process broadcast floor, us per call (mean of %d after %d warm-up)\n",
           iters, kWarmup);
    printf("%12s | %8s | %8s %10s %10s | %8s %10s\n", "size(B)", "local", "stages",
           "root busy", "peer busy", "readv", "readv huge");
  }
  uint64_t seq = 0, round = 0;
  for (size_t bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
    // Page-aligned private buffers, touched first, as MXNet's would be.
    char* buffer = aligned_alloc(kPage, (bytes + kPage - 1) / kPage * kPage);
    char* other = aligned_alloc(kPage, (bytes + kPage - 1) / kPage * kPage);
    if (buffer == NULL || other == NULL) Fail("out of memory");
    memset(buffer, root ? 1 : 0, bytes);
    memset(other, 0, bytes);
    double busy;
    const double staged = Stages(stages, buffer, bytes, root, iters, &seq, &busy);
    if (!root) sh->peer_busy = busy;
    if (!root && buffer[bytes - 1] != 1) Fail("the stages delivered wrong bytes");
    memset(buffer, root ? 1 : 0, bytes);
    if (root) sh->root_buffer = (uintptr_t)buffer;
    // The peer spins on `ready`, which the root sets only after
    // root_buffer above.
    const double readv = Readv(buffer, bytes, root, iters, &round);
    if (!root && buffer[bytes - 1] != 1) Fail("process_vm_readv delivered wrong bytes");
    // The same on huge pages: 2 MiB-aligned, advised before the first touch.
    const size_t huge_bytes = (bytes + kHuge - 1) / kHuge * kHuge;
    char* huge = aligned_alloc(kHuge, huge_bytes);
    if (huge == NULL) Fail("out of memory");
    madvise(huge, huge_bytes, MADV_HUGEPAGE);  // best effort, as numpy's
    memset(huge, root ? 1 : 0, bytes);
    if (root) sh->root_buffer = (uintptr_t)huge;
    const double readv_huge = Readv(huge, bytes, root, iters, &round);
    if (!root && huge[bytes - 1] != 1) Fail("process_vm_readv delivered wrong bytes");
    // The peer published its busy time before the readv rounds, which the
    // root waited through.
    const double local = root ? Local(buffer, other, bytes, iters) : 0;
    if (root) {
      printf("%12zu | %8.1f | %8.1f %10.1f %10.1f | %8.1f %10.1f\n", bytes, local * 1e6,
             staged * 1e6, busy * 1e6, sh->peer_busy * 1e6, readv * 1e6,
             readv_huge * 1e6);
      fflush(stdout);
    }
    free(buffer);
    free(other);
    free(huge);
  }
  if (root) {
    int status;
    waitpid(child, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
  }
  return 0;
}
