// The job: see job.h.
#include "job/job.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <string>

#include "base/logging.h"
#include "base/timeline.h"
#include "comm/mpi_comm.h"
#include "config/env_config.h"
#include "job/comm_wiring.h"
#include "job/secret_key.h"
#include "platform/cpu_binding.h"
#include "platform/output_pool.h"

namespace hvdmx {
namespace {

// The process-wide state. Set 0 is the global set; every rank knows every
// set's ranks, but holds a runtime only for the sets it belongs to.
struct Global {
  std::mutex mu;
  std::shared_ptr<Runtime> runtime;  // the global set's
  Topology topo;
  HostMap hosts;                 // which ranks of the job share a host (Note [One host split])
  int thread_level = 0;          // MPI's; -1 in a job without MPI
  bool thread_multiple = false;  // whether it is MPI_THREAD_MULTIPLE
  Config config;
  std::unique_ptr<Group> world;  // the job's ranks (an MPI duplicate, or a rendezvous)
  std::map<int, std::shared_ptr<Runtime>> sets;  // ids >= 1 this rank belongs to
  std::map<int, std::vector<int>> set_ranks;     // ids >= 1, every rank
  int next_set_id = 1;
  NegotiationCommWrapper wrap_negotiation;  // empty unless the tests' module set it
};

Global& G() {
  static Global* g = new Global();  // never destroyed: engine threads may outlive main
  return *g;
}

// Whether the global runtime runs. Callers hold G().mu.
bool Running() { return G().runtime && !G().runtime->stopped(); }

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

// A fingerprint of a list of ints (FNV-1a over them, plus their count), for
// ranks to check cheaply that they hold the same list.
uint64_t Fingerprint(const std::vector<int>& values) {
  uint64_t print = 1469598103934665603ULL;
  for (int v : values) print = (print ^ static_cast<uint64_t>(v + 1)) * 1099511628211ULL;
  return print ^ values.size();
}

// Binds this process's threads to one CPU where HVDMX_CPU_BIND says so (see
// Note [Binding a rank's threads to one CPU]). Collective over `group`,
// whose hosts `hosts` describes: the ranks of this host compare their CPUs.
void MaybeBindToCpu(Group& group, const HostMap& hosts, CpuBind mode) {
  const int rank = group.rank();
  const int local_rank = hosts.local_rank(rank), local_size = hosts.local_size(rank);
  const std::vector<int> cpus = CurrentCpus();
  const int64_t print = static_cast<int64_t>(Fingerprint(cpus));
  // Every rank of the host has the same CPUs when every fingerprint is this one's.
  const std::vector<int64_t> prints = AllgatherInts(group, {print});
  bool same = true;
  for (int r : hosts.host_ranks(rank)) same &= prints[static_cast<size_t>(r)] == print;
  const int cpu = ChooseCpu(mode, cpus, local_rank, local_size, same);
  if (cpu < 0) return;
  const int threads = BindAllThreads(cpu);
  HVDMX_LOG(kDebug) << "init: bound " << threads << " threads to CPU " << cpu << " (local rank "
                    << local_rank << " of " << local_size << ", " << cpus.size()
                    << " CPUs; HVDMX_CPU_BIND=" << CpuBindName(mode) << ")";
}

// Stops every runtime this rank holds, process sets first (every rank stops
// them in the same order, id order), and forgets the sets. Callers hold mu.
void StopAllLocked() {
  for (auto& kv : G().sets) kv.second->Shutdown();
  G().sets.clear();
  G().set_ranks.clear();
  if (G().runtime) G().runtime->Shutdown();
  G().runtime.reset();
  G().world.reset();
  ProcessTimeline().Stop();
  UnbindAllThreads();
}

// Every rank must plan the same collectives, so the settings that decide
// fusion groups, the algorithm and its layout, and the response cache must
// agree: compared at init (one allgather) and refused on every rank alike,
// instead of a hang or wrong sums later. Cycle time, timeline, logging and
// stall times may differ; autotune is rank 0's alone.
Status CheckSettingsAgree(Group& group, const Config& c) {
  const int size = group.size();
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
  std::vector<int64_t> values(n);
  for (int i = 0; i < n; ++i) values[i] = mine[i].value;
  const std::vector<int64_t> all = AllgatherInts(group, values);
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

Status JobTopology(Topology* topology, bool* thread_multiple) {
  std::lock_guard<std::mutex> lock(G().mu);
  if (!G().runtime) return Status::InvalidArgument(kNotInitialized);
  *thread_multiple = G().thread_multiple;
  *topology = G().topo;
  return Status::Ok();
}

Status JobHosts(std::vector<std::vector<int>>* hosts) {
  std::lock_guard<std::mutex> lock(G().mu);
  if (!G().runtime) return Status::InvalidArgument(kNotInitialized);
  *hosts = G().hosts.hosts();
  return Status::Ok();
}

bool JobRunning() {
  std::lock_guard<std::mutex> lock(G().mu);
  return Running();
}

Status JobStopStatus() {
  std::lock_guard<std::mutex> lock(G().mu);
  return G().runtime ? G().runtime->stop_status() : Status::Ok();
}

double JobStallShutdownSeconds() {
  std::lock_guard<std::mutex> lock(G().mu);
  return G().config.stall_shutdown_seconds;
}

std::vector<int> JobProcessSetIds() {
  std::lock_guard<std::mutex> lock(G().mu);
  std::vector<int> ids{0};
  for (const auto& kv : G().set_ranks) ids.push_back(kv.first);
  return ids;
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

namespace {

// Starts hvdmx over `world`, the job's group; MPI's thread level, or -1
// when the job runs without MPI, and whether it is MPI_THREAD_MULTIPLE.
// Callers hold mu.
Status StartLocked(std::unique_ptr<Group> world, int thread_level, bool thread_multiple) {
  StopAllLocked();
  Config config;
  Status status = LoadConfig(ProcessEnvironment(), &config);
  if (!status.ok()) return status;
  SetLogLevel(config.log_level);
  OutputPool::Get().SetLimit(config.output_pool_bytes);
  G().config = config;
  G().thread_level = thread_level;
  G().thread_multiple = thread_multiple;
  if (thread_level >= 0 && !thread_multiple) {
    HVDMX_LOG(kWarning) << "MPI provides thread level " << thread_level
                        << ", not MPI_THREAD_MULTIPLE; do not call MPI from Python while "
                           "hvdmx collectives are running";
  }
  if (thread_level < 0 && config.transport == Transport::kMpi) {
    return Status::InvalidArgument(
        "hvdmx.init: HVDMX_TRANSPORT=mpi, but this job was started without MPI (hvdmxrun "
        "--no-mpi); unset it, or start the job with MPI");
  }
  Group& group = *world;
  G().hosts = FindHosts(group);
  G().topo = TopologyOf(G().hosts, group.rank());
  SetLogRank(G().topo.rank);
  status = CheckSettingsAgree(group, config);
  if (!status.ok()) return status;
  status = AgreeOnSecretKey(group, &G().config.secret_key);
  if (!status.ok()) return status;
  HVDMX_LOG(kDebug) << "init: size " << G().topo.size << ", local_size " << G().topo.local_size
                    << (thread_level < 0 ? ", without MPI, " : ", ") << config.ToString();
  G().next_set_id = 1;
  if (!config.timeline_path.empty() && G().topo.rank == 0) {
    status = ProcessTimeline().Start(config.timeline_path, config.timeline_mark_cycles);
    if (!status.ok()) return status;
  }
  // Before the runtime starts, so that its thread starts bound.
  MaybeBindToCpu(group, G().hosts, config.cpu_bind);
  G().runtime = StartRuntime(group, G().hosts, G().config, G().wrap_negotiation);
  G().world = std::move(world);
  return Status::Ok();
}

}  // namespace

void SetNegotiationCommWrapper(NegotiationCommWrapper wrap) {
  std::lock_guard<std::mutex> lock(G().mu);
  G().wrap_negotiation = std::move(wrap);
}

Status Init(uintptr_t comm_address) {
  std::lock_guard<std::mutex> lock(G().mu);
  if (Running()) return Status::Ok();  // a second init is a no-op
  if (!MpiPluginLoaded()) {
    return Status::InvalidArgument(
        "hvdmx.init: MPI is not loaded (hvdmx._mpi.load_mpi loads it); install an MPI (pip "
        "install mpich mpi4py), or start the job with hvdmxrun --no-mpi");
  }
  bool multiple = false;
  const int thread_level = EnsureMpiInitialized(&multiple);
  const hvdmx_mpi_handle comm = Mpi().comm_at(reinterpret_cast<const void*>(comm_address));
  return StartLocked(std::make_unique<MpiGroup>(comm), thread_level, multiple);
}

Status InitOver(std::unique_ptr<Group> world) {
  std::lock_guard<std::mutex> lock(G().mu);
  if (Running()) return Status::Ok();
  return StartLocked(std::move(world), -1, false);
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
  const bool member = std::find(ranks.begin(), ranks.end(), G().topo.rank) != ranks.end();
  bool agree = true;
  const std::vector<int64_t> all = AllgatherInts(*G().world, {static_cast<int64_t>(mine)});
  for (int64_t h : all) agree &= h == all[0];
  if (!agree) {
    return Status::InvalidArgument(
        "hvdmx.add_process_set: ranks differ between processes; every rank must call "
        "add_process_set with the same ranks, in the same order of calls");
  }
  std::unique_ptr<Group> sub = G().world->Split(member ? ranks[0] : -1, G().topo.rank);
  *id = G().next_set_id++;
  G().set_ranks[*id] = ranks;
  if (member) {
    G().sets[*id] = StartRuntime(*sub, HostsOfSubgroup(*sub, G().hosts, G().topo.rank), G().config,
                                 G().wrap_negotiation);
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
