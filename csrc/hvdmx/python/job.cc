// The process-wide state behind hvdmx._core: see job.h.
#include "python/job.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>

#include "algorithms/adasum.h"
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

// The job's shape, and in *hosts every host's ranks (hosts in the order of
// their lowest rank).
Topology ComputeTopology(Group& group, std::vector<std::vector<int>>* hosts) {
  Topology t;
  t.rank = group.rank();
  t.size = group.size();
  std::unique_ptr<Group> local = group.SplitByHost();
  t.local_rank = local->rank();
  t.local_size = local->size();
  // A host is named by its lowest rank.
  const std::vector<int64_t> host_of = AllgatherInts(group, {GroupMin(*local, t.rank)});
  hosts->clear();
  std::map<int64_t, size_t> index;
  for (int r = 0; r < t.size; ++r) {
    const int64_t h = host_of[static_cast<size_t>(r)];
    // A host's lowest rank is a rank no greater than the sender's own (the
    // bytes may have crossed the network through a rendezvous).
    if (h < 0 || h > r) {
      throw std::runtime_error("hvdmx.init: rank " + std::to_string(r) + " named rank " +
                               std::to_string(h) +
                               " as its host's lowest, which cannot be; every rank must "
                               "run the same hvdmx");
    }
    if (!index.count(h)) {
      index[h] = hosts->size();
      hosts->emplace_back();
    }
    (*hosts)[index[h]].push_back(r);
  }
  std::unique_ptr<Group> cross = group.Split(t.local_rank, t.rank);
  t.cross_rank = cross->rank();
  t.cross_size = cross->size();
  return t;
}

// Whether another rank of `group` runs on this host. Collective over `group`.
bool PeersOnThisHost(Group& group) { return HostRankCount(group) > 1; }

// A fingerprint of a list of ints (FNV-1a over them, plus their count), for
// ranks to check cheaply that they hold the same list.
uint64_t Fingerprint(const std::vector<int>& values) {
  uint64_t print = 1469598103934665603ULL;
  for (int v : values) print = (print ^ static_cast<uint64_t>(v + 1)) * 1099511628211ULL;
  return print ^ values.size();
}

// Binds this process's threads to one CPU where HVDMX_CPU_BIND says so (see
// Note [Binding a rank's threads to one CPU]). Collective over `group`: the
// ranks of this host compare their CPUs.
void MaybeBindToCpu(Group& group, CpuBind mode) {
  std::unique_ptr<Group> local = group.SplitByHost();
  const int local_rank = local->rank(), local_size = local->size();
  const std::vector<int> cpus = CurrentCpus();
  const int64_t print = static_cast<int64_t>(Fingerprint(cpus));
  // Every rank of the host has the same CPUs when every fingerprint is this one's.
  bool same = true;
  for (int64_t theirs : AllgatherInts(*local, {print})) same &= theirs == print;
  local.reset();
  const int cpu = ChooseCpu(mode, cpus, local_rank, local_size, same);
  if (cpu < 0) return;
  const int threads = BindAllThreads(cpu);
  HVDMX_LOG(kDebug) << "init: bound " << threads << " threads to CPU " << cpu << " (local rank "
                    << local_rank << " of " << local_size << ", " << cpus.size()
                    << " CPUs; HVDMX_CPU_BIND=" << CpuBindName(mode) << ")";
}

// Whether the ranks of `group` talk over hvdmx's own TCP sockets (see
// Config::transport): always without MPI. Collective over `group`.
bool UseTcp(Group& group, Transport transport) {
  if (dynamic_cast<MpiGroup*>(&group) == nullptr) return true;
  if (transport != Transport::kAuto) return transport == Transport::kTcp;
  return HostRankCount(group) < group.size();
}

// The negotiation's comm over `comm` (Note [Negotiation across hosts] in
// shm/host_tree_comm.h): through shared memory and the hosts' leaders
// where the hosts have the same number of ranks (`shm` is hierarchical),
// else over every rank of `group` alike. Collective over `group`.
std::unique_ptr<Comm> NegotiationComm(Group& group, const Config& config, bool busy, ShmHost* shm) {
  const int rank = group.rank(), size = group.size();
  const int on_this_host = HostRankCount(group);
  const bool across_hosts = config.transport == Transport::kTcp && on_this_host < size;
  const bool tree = across_hosts && shm != nullptr && shm->hierarchical() &&
                    Controller::BitWords(config.cache_capacity) <= ShmControl::kMaxBitAndWords;
  if (!tree) {
    // With one rank on every host the leaders are all the ranks: nothing to say.
    const int64_t most_on_a_host = GroupMax(group, on_this_host);
    if (across_hosts && most_on_a_host > 1 && rank == 0) {
      HVDMX_LOG(kWarning) << "hvdmx: negotiation runs over all " << size
                          << " ranks alike (recursive doubling beyond "
                          << P2PComm::kDirectBitAndRanks
                          << "), not through one leader a host, which needs the same number "
                             "of ranks on every host, shared memory between them and "
                             "HVDMX_HIERARCHICAL_ALLREDUCE not 0 (docs/scaling.md)";
    }
    return CommOver(group, config, busy, CommUse::kNegotiation);
  }
  std::unique_ptr<Group> leaders_group = group.Split(shm->rank() == 0 ? 0 : -1, rank);
  std::unique_ptr<P2PComm> leaders;
  if (leaders_group != nullptr) {
    std::unique_ptr<Comm> made = CommOver(*leaders_group, config, busy, CommUse::kNegotiation);
    leaders.reset(dynamic_cast<P2PComm*>(made.release()));
    HVDMX_CHECK(leaders != nullptr, "the leaders' comm is a TCP comm");
  }
  return std::make_unique<HostTreeComm>(&shm->control(), shm->rank(), shm->size(),
                                        std::move(leaders), rank, size);
}

// The ranks the hierarchical Adasum pairs with this one, which the data
// comm links with besides its own (Note [The data comm's links] in
// comm/p2p_comm.h): none unless it is on and the data travels over TCP.
// Collective over `group` (every rank agrees on both settings).
std::vector<int> AdasumPeers(Group& group, const Config& config) {
  if (config.transport != Transport::kTcp || !config.adasum_hierarchical) return {};
  const std::vector<std::string> keys = group.Allgather(AdasumHostKey(config, group.rank()));
  return AdasumHierarchicalPeers(keys, group.rank());
}

// Collective over `group`.
std::shared_ptr<Runtime> StartRuntime(Group& group) {
  Config config = G().config;
  config.transport = UseTcp(group, config.transport) ? Transport::kTcp : Transport::kMpi;
  std::unique_ptr<ShmHost> shm = CreateNodeShm(group, config);
  const bool busy = config.transport == Transport::kTcp && HostRanksOutnumberCpus(group);
  std::unique_ptr<Comm> control = NegotiationComm(group, config, busy, shm.get());
  if (G().wrap_negotiation) control = G().wrap_negotiation(std::move(control));
  std::unique_ptr<Comm> data =
      CommOver(group, config, busy, CommUse::kData, AdasumPeers(group, config));
  auto runtime = std::make_shared<Runtime>(std::move(control), std::move(data), config,
                                           std::move(shm), PeersOnThisHost(group));
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

Status JobTopology(Topology* topology, int* thread_level) {
  std::lock_guard<std::mutex> lock(G().mu);
  if (!G().runtime) return Status::InvalidArgument(kNotInitialized);
  *thread_level = G().thread_level;
  *topology = G().topo;
  return Status::Ok();
}

Status JobHosts(std::vector<std::vector<int>>* hosts) {
  std::lock_guard<std::mutex> lock(G().mu);
  if (!G().runtime) return Status::InvalidArgument(kNotInitialized);
  *hosts = G().hosts;
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

namespace {

// Starts hvdmx over `world`, the job's group; MPI's thread level, or -1
// when the job runs without MPI. Callers hold mu.
Status StartLocked(std::unique_ptr<Group> world, int thread_level) {
  StopAllLocked();
  Config config;
  Status status = LoadConfig(ProcessEnvironment(), &config);
  if (!status.ok()) return status;
  SetLogLevel(config.log_level);
  OutputPool::Get().SetLimit(config.output_pool_bytes);
  G().config = config;
  G().thread_level = thread_level;
  if (thread_level >= 0 && thread_level < MPI_THREAD_MULTIPLE) {
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
  G().topo = ComputeTopology(group, &G().hosts);
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
  MaybeBindToCpu(group, config.cpu_bind);
  G().runtime = StartRuntime(group);
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
  const int thread_level = EnsureMpiInitialized();
  MPI_Comm comm = comm_address ? *reinterpret_cast<MPI_Comm*>(comm_address) : MPI_COMM_WORLD;
  return StartLocked(std::make_unique<MpiGroup>(comm), thread_level);
}

Status InitOver(std::unique_ptr<Group> world) {
  std::lock_guard<std::mutex> lock(G().mu);
  if (Running()) return Status::Ok();
  return StartLocked(std::move(world), -1);
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
  if (member) G().sets[*id] = StartRuntime(*sub);
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
