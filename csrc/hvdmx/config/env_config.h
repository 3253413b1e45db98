// The one reader of hvdmx's environment variables (MXNet's own
// MXNET_ENGINE_TYPE is read in mxnet_engine.cc). LoadConfig turns HVDMX_* variables (or
// their HOROVOD_* twins, so existing job scripts keep their tuning) into one
// validated Config. Tests pass a map instead of the real environment.
// docs/env.md lists every variable with its default; keep the two in step.
#ifndef HVDMX_ENV_CONFIG_H_
#define HVDMX_ENV_CONFIG_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "base/common.h"
#include "base/logging.h"
#include "platform/cpu_binding.h"
#include "platform/output_pool.h"
#include "platform/stage_stores.h"

namespace hvdmx {

// How an allreduce runs (HVDMX_ALLREDUCE_ALGO): chosen by size (kAuto), our
// ring, the data comm's own allreduce (kNative: DataComm::NativeAllreduce,
// MPI_Allreduce over MPI; spelled "mpi" in the variable and in
// AllreduceAlgoName, as users know it), or shared memory.
enum class AllreduceAlgo : int { kAuto = 0, kRing, kNative, kShm };
std::string AllreduceAlgoName(AllreduceAlgo algo);

// Config::shm_direct_min_bytes under HVDMX_SHM_DIRECT_MIN_BYTES=auto.
constexpr int64_t kShmDirectAuto = -2;

enum class Transport { kAuto, kTcp, kMpi };
const char* TransportName(Transport transport);

struct Config {
  // HVDMX_FUSION_THRESHOLD: bytes of one fusion buffer; 0 disables fusion.
  int64_t fusion_threshold = 64 * 1024 * 1024;
  // HVDMX_FUSION_MAX_TENSOR_BYTES: a tensor larger than this is never fused:
  // it is reduced in place, alone, sparing the two copies through the fusion
  // buffer, which cost more than the call they save for large tensors (see
  // docs/benchmark-notes.md, "Fusion and large tensors: the ResNet-50
  // gradient set").
  int64_t fusion_max_tensor_bytes = 256 * 1024;
  // HVDMX_FUSION_PIECE_BYTES: a fused group that goes through the fusion
  // buffer (not shared memory) is copied in, reduced and copied out in
  // pieces of at most this many bytes (see docs/algorithms.md).
  int64_t fusion_piece_bytes = 1024 * 1024;
  // HVDMX_OUTPUT_POOL_BYTES: bytes of returned output memory kept for the
  // next outputs (Note [Output pool] in output_pool.h); 0 keeps none.
  int64_t output_pool_bytes = OutputPool::kDefaultLimitBytes;
  // HVDMX_CYCLE_TIME: milliseconds the background thread waits after it is
  // woken, to batch more tensors into one round. 0: run at once.
  double cycle_time_ms = 0.0;
  // HVDMX_CACHE_CAPACITY: responses remembered for the fast path; 0 disables.
  int64_t cache_capacity = 1024;
  // HVDMX_ALLREDUCE_ALGO: auto | ring | mpi | shm.
  AllreduceAlgo allreduce_algo = AllreduceAlgo::kAuto;
  // HVDMX_RING_MIN_BYTES: with algo=auto, messages of at least this many
  // bytes use our ring, smaller ones MPI_Allreduce (see
  // docs/benchmark-notes.md, "Bandwidth, and the choice between our ring
  // and MPI_Allreduce").
  int64_t ring_min_bytes = 512 * 1024;
  // HVDMX_RING_SEGMENT_BYTES: the ring's pipelining unit.
  int64_t ring_segment_bytes = 256 * 1024;
  // HVDMX_ROUND_ALLREDUCE_BYTES: cached allreduces of at most this many
  // bytes in all ride with the negotiation round's bit-and and complete in
  // it (Note [Small tensors in the round] in negotiation/round_reduction.h);
  // 0 turns that off.
  int64_t round_allreduce_bytes = 4096;
  static constexpr int64_t kMaxRoundAllreduceBytes = 16384;
  // HVDMX_SHM_MIN_BYTES: with algo=auto and every rank on one host, messages
  // of at least this many bytes use the shared-memory allreduce, smaller ones
  // MPI_Allreduce (see docs/benchmark-notes.md, "One host: the shared-memory
  // allreduce").
  int64_t shm_min_bytes = 0;
  // HVDMX_SHM_CHUNK_BYTES: the shared-memory allreduce's pipelining unit per
  // rank (rounded down to a multiple of 64).
  int64_t shm_chunk_bytes = 256 * 1024;
  // HVDMX_SHM_DIRECT_MIN_BYTES: broadcasts, allgathers and alltoalls through
  // shared memory whose largest block has at least this many bytes are read
  // straight from the peers' buffers (cross-memory attach, one copy instead
  // of two; see docs/algorithms.md) where the kernel allows it. -1: never.
  // auto (kShmDirectAuto, the default): alltoalls and broadcasts from
  // ShmExchange::kAutoDirectMinBytes, allgathers never, as measured in
  // docs/benchmark-notes.md, "Single-copy moves and huge pages" and
  // "Broadcasts read directly, the root writing half".
  int64_t shm_direct_min_bytes = kShmDirectAuto;
  // HVDMX_SHM_STREAMING_STORES: auto, 0 or 1. How the shared-memory
  // allreduce writes what peers read: 1 streams it to memory, 0 leaves it in
  // this core's caches, auto measures both as the job runs and keeps the
  // faster (Note [Streaming stores into the stages]). May differ per rank.
  StageStores shm_streaming_stores = StageStores::kAuto;
  // HVDMX_HUGE_PAGES: 1 puts the whole 2 MiB pages of buffers that peers on
  // this host read with cross-memory attach onto transparent huge pages,
  // once per page (Note [Huge pages under what peers read]); 0 never.
  bool huge_pages = true;
  // HVDMX_SHM_PUSH: 1 lets allgathers and alltoalls through shared memory
  // write each rank's rows straight into its peers' outputs, which then come
  // from a shared-memory file (Note [Writing into peers' outputs] in
  // shm_exchange_push.cc); 0 never. Needs the output pool on every rank.
  bool shm_push = true;
  // HVDMX_CPU_BIND: auto, core or none. Whether hvd.init() binds every
  // thread of the process to one CPU (Note [Binding a rank's threads to one
  // CPU] in cpu_binding.h); auto: when the host's ranks are at least as many
  // as their CPUs. May differ per rank.
  CpuBind cpu_bind = CpuBind::kAuto;
  // HVDMX_HALF_PARTIALS: float32 or half. How float16 and bfloat16
  // allreduces and reducescatters pass partial results between ranks: in
  // float32, rounded once at the end (Note [Half precision summed in
  // float32] in reduce_kernels.cc), or with `half` in the dtype on the ring
  // (and between hosts) and never through MPI, rounded at every step, which
  // halves the ring's reduce-scatter bytes. Shared memory inside a host
  // always sums in float32.
  bool half_partials_wide = true;
  // HVDMX_HIERARCHICAL_ALLREDUCE (HOROVOD_HIERARCHICAL_ALLREDUCE): 0 or 1.
  // 1: on several hosts with equal rank counts, shared memory inside each
  // host and our ring between hosts (shm_allreduce.h). Unset (the default):
  // the same where the hosts allow it, without the warning where they do
  // not (hierarchical_allreduce_set is false).
  bool hierarchical_allreduce = false;
  bool hierarchical_allreduce_set = false;
  // HVDMX_ADASUM_HIERARCHICAL: 0 or 1 (default 0). 1: op=Adasum averages
  // inside each host and runs Adasum between hosts only
  // (HierarchicalAdasumAllreduce in algorithms/adasum.h); 0: Adasum over
  // every rank.
  bool adasum_hierarchical = false;
  // HVDMX_TRANSPORT: auto, tcp or mpi. How ranks on different hosts talk
  // (the negotiation, and the collectives' bytes that do not go through
  // shared memory): tcp through hvdmx's own sockets (comm/tcp_comm.h), mpi
  // through MPI. auto: tcp when the job spans hosts, else mpi.
  Transport transport = Transport::kAuto;
  // HVDMX_TCP_IFACE: the interface whose address the tcp transport listens
  // on; empty: see TcpOptions::iface.
  std::string tcp_iface;
  // HVDMX_SECRET_KEY: the job's secret key, 64 hex digits (256 bits), that
  // every TCP connection between ranks proves (Note [Authenticating a
  // connection] in comm/tcp_handshake.h); held here as its 32 bytes. Unset:
  // rank 0 makes one at init and sends it to the others over MPI. Never
  // logged.
  std::string secret_key;
  // HVDMX_TCP_SPIN_MICROS: how long a wait of the tcp transport keeps trying
  // its sockets (yielding the CPU between tries) before it blocks in
  // poll(2); -1 (auto): 50 us, or 0 where the host's ranks outnumber its
  // CPUs (TcpOptions::spin_micros).
  int64_t tcp_spin_micros = -1;
  // HVDMX_TESTING_RANKS_PER_HOST: for tests only. > 0 pretends that each
  // run of this many consecutive ranks is one host; 0 asks MPI.
  int64_t testing_ranks_per_host = 0;
  // HVDMX_TESTING_LINK_DELAY_SECONDS: for tests only. The TCP transport
  // waits this long between the address exchange and making its links, so
  // that a test can reach the listening ports from outside the job first.
  double testing_link_delay_seconds = 0;
  // HVDMX_LOG_LEVEL: trace, debug, info, warning, error, fatal.
  LogLevel log_level = LogLevel::kWarning;
  // HVDMX_STALL_CHECK_TIME_SECONDS: warn when this rank has waited this long
  // for its peers to submit the tensors it has submitted. 0 disables.
  double stall_check_seconds = 60.0;
  // HVDMX_STALL_SHUTDOWN_TIME_SECONDS: after this long, the stalled
  // collectives fail on every rank with the stall report instead of waiting
  // on. 0: never.
  double stall_shutdown_seconds = 0.0;
  // HVDMX_ELASTIC_SLOT set (hvdmxrun sets it for an elastic job's workers,
  // docs/elastic.md): the job goes on when a peer is lost, so the loss is
  // logged as a warning, not an error (Runtime::StopAfterPeer).
  bool elastic = false;
  // HVDMX_TIMELINE: path of the Chrome trace rank 0 writes; empty: none.
  std::string timeline_path;
  // HVDMX_TIMELINE_MARK_CYCLES: 1 marks every negotiation round in it.
  bool timeline_mark_cycles = false;
  // HVDMX_AUTOTUNE: 1 tunes the fusion threshold, cycle time and algorithm online
  // (autotune.h); HVDMX_AUTOTUNE_LOG: CSV of its trials (rank 0).
  bool autotune = false;
  std::string autotune_log;
  // Whether the user set HVDMX_FUSION_THRESHOLD / HVDMX_CYCLE_TIME /
  // HVDMX_ALLREDUCE_ALGO or HVDMX_HIERARCHICAL_ALLREDUCE=1 (or a twin):
  // autotune leaves such a value alone.
  bool fusion_threshold_fixed = false;
  bool cycle_time_fixed = false;
  bool allreduce_algo_fixed = false;

  std::string ToString() const;
};

using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;

// Reads the process environment.
EnvLookup ProcessEnvironment();

// Fills *out from `lookup`. A value that does not parse, or is out of range,
// gives InvalidArgument naming the variable, the value and what is accepted.
Status LoadConfig(const EnvLookup& lookup, Config* out);

}  // namespace hvdmx

#endif  // HVDMX_ENV_CONFIG_H_
