// The process-wide state behind hvdmx._core: see job.h.
#include "python/job.h"

#include <algorithm>
#include <string>

#include "base/logging.h"
#include "base/timeline.h"
#include "comm/mpi_comm.h"
#include "platform/cpu_binding.h"
#include "platform/output_pool.h"
#include "shm/host_tree_comm.h"
#include "shm/shm_segment.h"

namespace hvdmx {

Global& G() {
  static Global* g = new Global();  // never destroyed: engine threads may outlive main
  return *g;
}

bool Running() { return G().runtime && !G().runtime->stopped(); }

namespace {

const char kNotInitialized[] =
    "hvdmx has not been initialized, or has been shut down; call hvd.init() first";

// The runtime of process set `set_id` (0: the global set). Callers hold mu.
Status SetRuntimeLocked(int set_id, std::shared_ptr<Runtime>* runtime) {
  if (!Running()) return Status::Shutdown(kNotInitialized);
  if (set_id == 0) {
    *runtime = G().runtime;
    return Status::Ok();
  }
  auto it = G().sets.find(set_id);
  if (it != G().sets.end()) {
    *runtime = it->second;
    return Status::Ok();
  }
  if (G().set_ranks.count(set_id)) {
    return Status::InvalidArgument("hvdmx: this rank (" + std::to_string(G().topo.rank) +
                                   ") is not in process set " + std::to_string(set_id) +
                                   "; only its ranks may call collectives on it");
  }
  return Status::InvalidArgument("hvdmx: process set " + std::to_string(set_id) +
                                 " does not exist (it was removed, or never added); add it "
                                 "with hvd.add_process_set on every rank first");
}

Topology ComputeTopology(MPI_Comm comm) {
  Topology t;
  MPI_Comm_rank(comm, &t.rank);
  MPI_Comm_size(comm, &t.size);
  MPI_Comm local, cross;
  MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, t.rank, MPI_INFO_NULL, &local);
  MPI_Comm_rank(local, &t.local_rank);
  MPI_Comm_size(local, &t.local_size);
  MPI_Comm_split(comm, t.local_rank, t.rank, &cross);
  MPI_Comm_rank(cross, &t.cross_rank);
  MPI_Comm_size(cross, &t.cross_size);
  MPI_Comm_free(&local);
  MPI_Comm_free(&cross);
  return t;
}

// Whether another rank of `comm` runs on this host. Collective over `comm`.
bool PeersOnThisHost(MPI_Comm comm) { return HostRankCount(comm) > 1; }

// A fingerprint of a list of ints (FNV-1a over them, plus their count), for
// ranks to check cheaply that they hold the same list.
uint64_t Fingerprint(const std::vector<int>& values) {
  uint64_t print = 1469598103934665603ULL;
  for (int v : values) print = (print ^ static_cast<uint64_t>(v + 1)) * 1099511628211ULL;
  return print ^ values.size();
}

// Binds this process's threads to one CPU where HVDMX_CPU_BIND says so (see
// Note [Binding a rank's threads to one CPU]). Collective over `comm`: the
// ranks of this host compare their CPUs.
void MaybeBindToCpu(MPI_Comm comm, CpuBind mode) {
  int rank = 0, local_rank = 0, local_size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm local;
  MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &local);
  MPI_Comm_rank(local, &local_rank);
  MPI_Comm_size(local, &local_size);
  const std::vector<int> cpus = CurrentCpus();
  const uint64_t print = Fingerprint(cpus);
  // The least of every rank's fingerprint and of its complement: both are
  // this rank's own only if every rank of the host has the same.
  uint64_t mine[2] = {print, ~print};
  uint64_t least[2] = {0, 0};
  MPI_Allreduce(mine, least, 2, MPI_UINT64_T, MPI_MIN, local);
  MPI_Comm_free(&local);
  const bool same = least[0] == mine[0] && least[1] == mine[1];
  const int cpu = ChooseCpu(mode, cpus, local_rank, local_size, same);
  if (cpu < 0) return;
  const int threads = BindAllThreads(cpu);
  HVDMX_LOG(kDebug) << "init: bound " << threads << " threads to CPU " << cpu << " (local rank "
                    << local_rank << " of " << local_size << ", " << cpus.size()
                    << " CPUs; HVDMX_CPU_BIND=" << CpuBindName(mode) << ")";
}

// Whether the ranks of `comm` talk over hvdmx's own TCP sockets (see
// Config::transport). Collective over `comm`.
bool UseTcp(MPI_Comm comm, Transport transport) {
  if (transport != Transport::kAuto) return transport == Transport::kTcp;
  int size = 1;
  MPI_Comm_size(comm, &size);
  return HostRankCount(comm) < size;
}

// The negotiation's comm over `comm` (Note [Negotiation across hosts] in
// shm/host_tree_comm.h): through shared memory and the hosts' leaders
// where the hosts have the same number of ranks (`shm` is hierarchical),
// else over every rank of `comm` alike. Collective over `comm`.
std::unique_ptr<Comm> NegotiationComm(MPI_Comm comm, const Config& config, bool busy,
                                      ShmHost* shm) {
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  const bool across_hosts = config.transport == Transport::kTcp && HostRankCount(comm) < size;
  const bool tree = across_hosts && shm != nullptr && shm->hierarchical() &&
                    Controller::BitWords(config.cache_capacity) <= ShmControl::kMaxBitAndWords;
  if (!tree) {
    // With one rank on every host the leaders are all the ranks: nothing to say.
    int most_on_a_host = HostRankCount(comm);
    MPI_Allreduce(MPI_IN_PLACE, &most_on_a_host, 1, MPI_INT, MPI_MAX, comm);
    if (across_hosts && most_on_a_host > 1 && rank == 0) {
      HVDMX_LOG(kWarning) << "hvdmx: negotiation runs over all " << size
                          << " ranks alike (recursive doubling beyond "
                          << P2PComm::kDirectBitAndRanks
                          << "), not through one leader a host, which needs the same number "
                             "of ranks on every host, shared memory between them and "
                             "HVDMX_HIERARCHICAL_ALLREDUCE not 0 (docs/scaling.md)";
    }
    return CommOver(comm, config, busy, /*for_negotiation=*/true);
  }
  MPI_Comm leaders_mpi;
  MPI_Comm_split(comm, shm->rank() == 0 ? 0 : MPI_UNDEFINED, rank, &leaders_mpi);
  std::unique_ptr<P2PComm> leaders;
  if (leaders_mpi != MPI_COMM_NULL) {
    std::unique_ptr<Comm> made = CommOver(leaders_mpi, config, busy, /*for_negotiation=*/true);
    MPI_Comm_free(&leaders_mpi);
    leaders.reset(dynamic_cast<P2PComm*>(made.release()));
    HVDMX_CHECK(leaders != nullptr, "the leaders' comm is a TCP comm");
  }
  return std::make_unique<HostTreeComm>(&shm->control(), shm->rank(), shm->size(),
                                        std::move(leaders), rank, size);
}

// Collective over `comm`.
std::shared_ptr<Runtime> StartRuntime(MPI_Comm comm) {
  Config config = G().config;
  config.transport = UseTcp(comm, config.transport) ? Transport::kTcp : Transport::kMpi;
  std::unique_ptr<ShmHost> shm = CreateNodeShm(comm, config);
  const bool busy = config.transport == Transport::kTcp && HostRanksOutnumberCpus(comm);
  std::unique_ptr<Comm> control = NegotiationComm(comm, config, busy, shm.get());
  std::unique_ptr<Comm> data = CommOver(comm, config, busy);
  auto runtime = std::make_shared<Runtime>(std::move(control), std::move(data), config,
                                           std::move(shm), PeersOnThisHost(comm));
  runtime->Start();
  return runtime;
}

// Stops every runtime this rank holds, process sets first (every rank stops
// them in the same order, id order), and forgets the sets. Callers hold mu.
void StopAllLocked() {
  for (auto& kv : G().sets) kv.second->Shutdown();
  G().sets.clear();
  G().set_ranks.clear();
  if (G().runtime) G().runtime->Shutdown();
  G().runtime.reset();
  if (G().world != MPI_COMM_NULL) MPI_Comm_free(&G().world);
  ProcessTimeline().Stop();
  UnbindAllThreads();
}

// Every rank must plan the same collectives, so the settings that decide
// fusion groups, the algorithm and its layout, and the response cache must
// agree: compared at init (one allgather) and refused on every rank alike,
// instead of a hang or wrong sums later. Cycle time, timeline, logging and
// stall times may differ; autotune is rank 0's alone.
Status CheckSettingsAgree(MPI_Comm comm, const Config& c, int size) {
  struct Setting {
    const char* var;
    int64_t value;
  };
  const Setting mine[] = {
      {"FUSION_THRESHOLD", c.fusion_threshold},
      {"FUSION_MAX_TENSOR_BYTES", c.fusion_max_tensor_bytes},
      {"FUSION_PIECE_BYTES", c.fusion_piece_bytes},
      {"CACHE_CAPACITY", c.cache_capacity},
      {"ALLREDUCE_ALGO", static_cast<int64_t>(c.allreduce_algo)},
      {"RING_MIN_BYTES", c.ring_min_bytes},
      {"RING_SEGMENT_BYTES", c.ring_segment_bytes},
      {"SHM_MIN_BYTES", c.shm_min_bytes},
      {"SHM_CHUNK_BYTES", c.shm_chunk_bytes},
      {"SHM_DIRECT_MIN_BYTES", c.shm_direct_min_bytes},
      {"SHM_PUSH", c.shm_push ? 1 : 0},
      {"HALF_PARTIALS", c.half_partials_wide ? 1 : 0},
      {"HIERARCHICAL_ALLREDUCE",
       c.hierarchical_allreduce_set ? (c.hierarchical_allreduce ? 1 : 0) : 2},
      {"TRANSPORT", static_cast<int64_t>(c.transport)},
      {"ADASUM_HIERARCHICAL", c.adasum_hierarchical ? 1 : 0},
      {"TESTING_RANKS_PER_HOST", c.testing_ranks_per_host},
  };
  constexpr int n = static_cast<int>(sizeof(mine) / sizeof(mine[0]));
  int64_t values[n];
  for (int i = 0; i < n; ++i) values[i] = mine[i].value;
  std::vector<int64_t> all(static_cast<size_t>(size) * n);
  MPI_Allgather(values, n, MPI_INT64_T, all.data(), n, MPI_INT64_T, comm);
  auto show = [&](int i, int64_t v) {
    if (std::string(mine[i].var) == "HALF_PARTIALS") return std::string(v ? "float32" : "half");
    if (std::string(mine[i].var) == "TRANSPORT")
      return std::string(TransportName(static_cast<Transport>(v)));
    if (std::string(mine[i].var) == "HIERARCHICAL_ALLREDUCE" && v == 2) return std::string("unset");
    return std::string(mine[i].var) == "ALLREDUCE_ALGO"
               ? AllreduceAlgoName(static_cast<AllreduceAlgo>(v))
               : std::to_string(v);
  };
  for (int i = 0; i < n; ++i) {
    for (int r = 1; r < size; ++r) {
      const int64_t theirs = all[static_cast<size_t>(r) * n + i];
      if (theirs == all[i]) continue;
      return Status::InvalidArgument(
          std::string("hvdmx.init: HVDMX_") + mine[i].var + " differs between ranks (rank 0: " +
          show(i, all[i]) + ", rank " + std::to_string(r) + ": " + show(i, theirs) +
          "); every rank must run with the same value. Set it (or its HOROVOD_ twin) the "
          "same way for all ranks, e.g. with mpiexec -genv or an hvdmxrun flag, or not at all");
    }
  }
  return Status::Ok();
}

}  // namespace

Status JobTopology(Topology* topology, int* thread_level) {
  std::lock_guard<std::mutex> lock(G().mu);
  if (!G().runtime) return Status::InvalidArgument(kNotInitialized);
  *thread_level = G().thread_level;
  *topology = G().topo;
  return Status::Ok();
}

Status RunningRuntime(int set_id, std::shared_ptr<Runtime>* runtime) {
  std::lock_guard<std::mutex> lock(G().mu);
  return SetRuntimeLocked(set_id, runtime);
}

bool AllIdle() {
  std::lock_guard<std::mutex> lock(G().mu);
  if (G().runtime && !G().runtime->NothingPending()) return false;
  for (const auto& kv : G().sets) {
    if (!kv.second->NothingPending()) return false;
  }
  return true;
}

Status Init(uintptr_t comm_address) {
  std::lock_guard<std::mutex> lock(G().mu);
  if (Running()) return Status::Ok();  // a second init is a no-op
  StopAllLocked();
  Config config;
  Status status = LoadConfig(ProcessEnvironment(), &config);
  if (!status.ok()) return status;
  SetLogLevel(config.log_level);
  OutputPool::Get().SetLimit(config.output_pool_bytes);
  G().config = config;
  G().thread_level = EnsureMpiInitialized();
  if (G().thread_level < MPI_THREAD_MULTIPLE) {
    HVDMX_LOG(kWarning) << "MPI provides thread level " << G().thread_level
                        << ", not MPI_THREAD_MULTIPLE; do not call MPI from Python while "
                           "hvdmx collectives are running";
  }
  MPI_Comm comm = comm_address ? *reinterpret_cast<MPI_Comm*>(comm_address) : MPI_COMM_WORLD;
  G().topo = ComputeTopology(comm);
  SetLogRank(G().topo.rank);
  status = CheckSettingsAgree(comm, config, G().topo.size);
  if (!status.ok()) return status;
  status = AgreeOnSecretKey(comm, &G().config.secret_key);
  if (!status.ok()) return status;
  HVDMX_LOG(kDebug) << "init: size " << G().topo.size << ", local_size " << G().topo.local_size
                    << ", " << config.ToString();
  MPI_Comm_dup(comm, &G().world);
  G().next_set_id = 1;
  if (!config.timeline_path.empty() && G().topo.rank == 0) {
    status = ProcessTimeline().Start(config.timeline_path, config.timeline_mark_cycles);
    if (!status.ok()) return status;
  }
  // Before the runtime starts, so that its thread starts bound.
  MaybeBindToCpu(comm, config.cpu_bind);
  G().runtime = StartRuntime(comm);
  return Status::Ok();
}

void Shutdown() {
  std::lock_guard<std::mutex> lock(G().mu);
  StopAllLocked();
}

Status AddProcessSet(const std::vector<int>& ranks, bool same_everywhere, int* id) {
  std::lock_guard<std::mutex> lock(G().mu);
  if (!Running()) return Status::Shutdown(kNotInitialized);
  if (same_everywhere) {
    for (const auto& kv : G().set_ranks) {
      if (kv.second == ranks) {
        return Status::InvalidArgument(
            "hvdmx.add_process_set: a process set with ranks " +
            ShapeString(std::vector<int64_t>(ranks.begin(), ranks.end())) + " already exists (id " +
            std::to_string(kv.first) + "); use that one");
      }
    }
  }
  // Every rank's list must be the same: compare a fingerprint of it.
  const uint64_t mine = same_everywhere ? Fingerprint(ranks) : Fingerprint({});
  std::vector<uint64_t> all(G().topo.size);
  MPI_Comm sub = MPI_COMM_NULL;
  const bool member = std::find(ranks.begin(), ranks.end(), G().topo.rank) != ranks.end();
  bool agree = true;
  MPI_Allgather(&mine, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, G().world);
  for (uint64_t h : all) agree &= h == all[0];
  if (!agree) {
    return Status::InvalidArgument(
        "hvdmx.add_process_set: ranks differ between processes; every rank must call "
        "add_process_set with the same ranks, in the same order of calls");
  }
  MPI_Comm_split(G().world, member ? ranks[0] : MPI_UNDEFINED, G().topo.rank, &sub);
  *id = G().next_set_id++;
  G().set_ranks[*id] = ranks;
  if (member) {
    G().sets[*id] = StartRuntime(sub);
    MPI_Comm_free(&sub);
  }
  return Status::Ok();
}

Status RemoveProcessSet(int id) {
  std::shared_ptr<Runtime> runtime;
  {
    std::lock_guard<std::mutex> lock(G().mu);
    if (!Running()) return Status::Shutdown(kNotInitialized);
    if (!G().set_ranks.count(id)) {
      return Status::InvalidArgument("hvdmx.remove_process_set: process set " + std::to_string(id) +
                                     " does not exist (already removed?)");
    }
    G().set_ranks.erase(id);
    auto it = G().sets.find(id);
    if (it == G().sets.end()) return Status::Ok();
    runtime = std::move(it->second);
    G().sets.erase(it);
  }
  runtime->Shutdown();  // collective over the set's ranks (see Note [Shutdown])
  return Status::Ok();
}

}  // namespace hvdmx
