// Thin pybind11 bindings: the module hvdmx._core. Maps Status to Python
// exceptions, releases the GIL around anything that waits, and holds the one
// process-wide Runtime. Functions whose names start with _testing exist for
// the test suite only.
#include <mpi.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "autotune.h"
#include "env_config.h"
#include "fusion_plan.h"
#include "local_comm.h"
#include "logging.h"
#include "mpi_comm.h"
#include "mxnet_engine.h"
#include "reduce_kernels.h"
#include "ring.h"
#include "runtime.h"
#include "timeline.h"
#include "shm_allreduce.h"
#include "shm_segment.h"

#ifndef HVDMX_MPI_VENDOR
#define HVDMX_MPI_VENDOR "unknown"
#endif
#ifndef HVDMX_NCCL_BUILT
#define HVDMX_NCCL_BUILT 0
#endif
#ifndef HVDMX_CUDA_BUILT
#define HVDMX_CUDA_BUILT 0
#endif

namespace py = pybind11;

namespace hvdmx {
namespace {

void ThrowIfError(const Status& status) {
  if (status.ok()) return;
  if (status.code() == Status::Code::kInvalidArgument) throw py::value_error(status.message());
  throw std::runtime_error(status.message());
}

struct Topology {
  int rank = 0, size = 1, local_rank = 0, local_size = 1, cross_rank = 0, cross_size = 1;
};

// The process-wide state: the job's shape and one runtime per process set.
// Set 0 is the global set; every rank knows every set's ranks, but holds a
// runtime only for the sets it belongs to.
struct Global {
  std::mutex mu;
  std::shared_ptr<Runtime> runtime;  // the global set's
  Topology topo;
  int thread_level = 0;
  Config config;
  MPI_Comm world = MPI_COMM_NULL;  // our duplicate of the job's communicator
  std::map<int, std::shared_ptr<Runtime>> sets;  // ids >= 1 this rank belongs to
  std::map<int, std::vector<int>> set_ranks;     // ids >= 1, every rank
  int next_set_id = 1;
};
Global& G() {
  static Global* g = new Global();  // never destroyed: engine threads may outlive main
  return *g;
}

const char kNotInitialized[] =
    "hvdmx has not been initialized, or has been shut down; call hvd.init() first";

bool Running() { return G().runtime && !G().runtime->stopped(); }

// The runtime of process set `set_id` (0: the global set). Callers hold mu.
std::shared_ptr<Runtime> SetRuntimeLocked(int set_id) {
  if (!Running()) throw std::runtime_error(kNotInitialized);
  if (set_id == 0) return G().runtime;
  auto it = G().sets.find(set_id);
  if (it != G().sets.end()) return it->second;
  if (G().set_ranks.count(set_id)) {
    throw py::value_error("hvdmx: this rank (" + std::to_string(G().topo.rank) +
                          ") is not in process set " + std::to_string(set_id) +
                          "; only its ranks may call collectives on it");
  }
  throw py::value_error("hvdmx: process set " + std::to_string(set_id) +
                        " does not exist (it was removed, or never added); add it with "
                        "hvd.add_process_set on every rank first");
}

std::shared_ptr<Runtime> RunningRuntime(int set_id = 0) {
  std::lock_guard<std::mutex> lock(G().mu);
  return SetRuntimeLocked(set_id);
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

// Collective over `comm`.
std::shared_ptr<Runtime> StartRuntime(MPI_Comm comm) {
  std::unique_ptr<ShmAllreduce> shm = CreateNodeShmAllreduce(comm, G().config);
  auto runtime = std::make_shared<Runtime>(std::make_unique<MpiComm>(comm),
                                           std::make_unique<MpiComm>(comm), G().config,
                                           std::move(shm));
  runtime->Start();
  return runtime;
}

// Stops every runtime this rank holds, process sets first (every rank stops
// them in the same order, id order), and forgets the sets. Callers hold mu.
void StopAllLocked() {
  py::gil_scoped_release release;
  for (auto& kv : G().sets) kv.second->Shutdown();
  G().sets.clear();
  G().set_ranks.clear();
  if (G().runtime) G().runtime->Shutdown();
  G().runtime.reset();
  if (G().world != MPI_COMM_NULL) MPI_Comm_free(&G().world);
  ProcessTimeline().Stop();
}

// Every rank must plan the same collectives, so the settings that decide
// fusion groups, the algorithm and its layout, and the response cache must
// agree: compared at init (one allgather) and refused on every rank alike,
// instead of a hang or wrong sums later. Cycle time, timeline, logging and
// stall times may differ; autotune is rank 0's alone.
void CheckSettingsAgree(MPI_Comm comm, const Config& c, int size) {
  struct Setting {
    const char* var;
    int64_t value;
  };
  const Setting mine[] = {
      {"FUSION_THRESHOLD", c.fusion_threshold},
      {"FUSION_MAX_TENSOR_BYTES", c.fusion_max_tensor_bytes},
      {"CACHE_CAPACITY", c.cache_capacity},
      {"ALLREDUCE_ALGO", static_cast<int64_t>(c.allreduce_algo)},
      {"RING_MIN_BYTES", c.ring_min_bytes},
      {"RING_SEGMENT_BYTES", c.ring_segment_bytes},
      {"SHM_MIN_BYTES", c.shm_min_bytes},
      {"SHM_CHUNK_BYTES", c.shm_chunk_bytes},
      {"HIERARCHICAL_ALLREDUCE", c.hierarchical_allreduce ? 1 : 0},
      {"TESTING_RANKS_PER_HOST", c.testing_ranks_per_host},
  };
  constexpr int n = static_cast<int>(sizeof(mine) / sizeof(mine[0]));
  int64_t values[n];
  for (int i = 0; i < n; ++i) values[i] = mine[i].value;
  std::vector<int64_t> all(static_cast<size_t>(size) * n);
  MPI_Allgather(values, n, MPI_INT64_T, all.data(), n, MPI_INT64_T, comm);
  auto show = [&](int i, int64_t v) {
    return std::string(mine[i].var) == "ALLREDUCE_ALGO"
               ? AllreduceAlgoName(static_cast<AllreduceAlgo>(v))
               : std::to_string(v);
  };
  for (int i = 0; i < n; ++i) {
    for (int r = 1; r < size; ++r) {
      const int64_t theirs = all[static_cast<size_t>(r) * n + i];
      if (theirs == all[i]) continue;
      throw py::value_error(std::string("hvdmx.init: HVDMX_") + mine[i].var +
                            " differs between ranks (rank 0: " + show(i, all[i]) + ", rank " +
                            std::to_string(r) + ": " + show(i, theirs) +
                            "); every rank must run with the same value. Set it (or its "
                            "HOROVOD_ twin) the same way for all ranks, e.g. with mpiexec "
                            "-genv or an hvdmxrun flag, or not at all");
    }
  }
}

void Init(uintptr_t comm_address) {
  std::lock_guard<std::mutex> lock(G().mu);
  if (Running()) return;  // a second init is a no-op
  StopAllLocked();
  Config config;
  ThrowIfError(LoadConfig(ProcessEnvironment(), &config));
  SetLogLevel(config.log_level);
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
  CheckSettingsAgree(comm, config, G().topo.size);
  HVDMX_LOG(kDebug) << "init: size " << G().topo.size << ", local_size " << G().topo.local_size
                    << ", " << config.ToString();
  MPI_Comm_dup(comm, &G().world);
  G().next_set_id = 1;
  if (!config.timeline_path.empty() && G().topo.rank == 0) {
    ThrowIfError(ProcessTimeline().Start(config.timeline_path, config.timeline_mark_cycles));
  }
  G().runtime = StartRuntime(comm);
}

void Shutdown() {
  std::lock_guard<std::mutex> lock(G().mu);
  StopAllLocked();
}

// Collective over the whole job. With `same_everywhere`, every rank passes the
// same sorted, distinct ranks (checked here, so a mismatch is an error
// everywhere, not a hang). Without, the set is a partition made from a split
// communicator: each rank passes its own group (checked by the caller) and
// every group becomes a set of its own under the one id.
int AddProcessSet(const std::vector<int>& ranks, bool same_everywhere) {
  std::lock_guard<std::mutex> lock(G().mu);
  if (!Running()) throw std::runtime_error(kNotInitialized);
  if (same_everywhere) {
    for (const auto& kv : G().set_ranks) {
      if (kv.second == ranks) {
        throw py::value_error("hvdmx.add_process_set: a process set with ranks " +
                              ShapeString(std::vector<int64_t>(ranks.begin(), ranks.end())) +
                              " already exists (id " + std::to_string(kv.first) +
                              "); use that one");
      }
    }
  }
  // Every rank's list must be the same: compare a fingerprint of it.
  uint64_t mine = 1469598103934665603ULL;
  if (same_everywhere) {
    for (int r : ranks) mine = (mine ^ static_cast<uint64_t>(r + 1)) * 1099511628211ULL;
    mine ^= ranks.size();
  }
  std::vector<uint64_t> all(G().topo.size);
  MPI_Comm sub = MPI_COMM_NULL;
  const bool member = std::find(ranks.begin(), ranks.end(), G().topo.rank) != ranks.end();
  bool agree = true;
  {
    py::gil_scoped_release release;
    MPI_Allgather(&mine, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, G().world);
    for (uint64_t h : all) agree &= h == all[0];
    if (agree) {
      MPI_Comm_split(G().world, member ? ranks[0] : MPI_UNDEFINED, G().topo.rank, &sub);
    }
  }
  if (!agree) {
    throw py::value_error("hvdmx.add_process_set: ranks differ between processes; every "
                          "rank must call add_process_set with the same ranks, in the same "
                          "order of calls");
  }
  const int id = G().next_set_id++;
  G().set_ranks[id] = ranks;
  if (member) {
    py::gil_scoped_release release;
    G().sets[id] = StartRuntime(sub);
    MPI_Comm_free(&sub);
  }
  return id;
}

void RemoveProcessSet(int id) {
  std::shared_ptr<Runtime> runtime;
  {
    std::lock_guard<std::mutex> lock(G().mu);
    if (!Running()) throw std::runtime_error(kNotInitialized);
    if (!G().set_ranks.count(id)) {
      throw py::value_error("hvdmx.remove_process_set: process set " + std::to_string(id) +
                            " does not exist (already removed?)");
    }
    G().set_ranks.erase(id);
    auto it = G().sets.find(id);
    if (it == G().sets.end()) return;
    runtime = std::move(it->second);
    G().sets.erase(it);
  }
  py::gil_scoped_release release;
  runtime->Shutdown();  // collective over the set's ranks (see Note [Shutdown])
}

Request MakeRequest(CollectiveType type, const std::string& name,
                    const std::vector<int>& dtypes,
                    const std::vector<std::vector<int64_t>>& shapes, int op, int root,
                    double prescale, double postscale, int dev_type, int dev_id, int rank) {
  Request q;
  q.rank = rank;
  q.type = type;
  q.name = name;
  for (int d : dtypes) q.dtypes.push_back(static_cast<DataType>(d));
  q.shapes = shapes;
  q.op = static_cast<ReduceOp>(op);
  q.root = root;
  q.prescale = prescale;
  q.postscale = postscale;
  q.device = dev_type == 2 ? dev_id : -1;
  return q;
}

void PushAsync(int set_id, int type, const std::string& name,
               const std::vector<uintptr_t>& inputs, const std::vector<uintptr_t>& outputs,
               const std::vector<int>& dtypes, const std::vector<std::vector<int64_t>>& shapes,
               int op, int root, double prescale, double postscale,
               const std::vector<int64_t>& splits, int priority, int dev_type, int dev_id) {
  std::shared_ptr<Runtime> runtime = RunningRuntime(set_id);
  PushArgs args;
  args.request = MakeRequest(static_cast<CollectiveType>(type), name, dtypes, shapes, op, root,
                             prescale, postscale, dev_type, dev_id, runtime->rank());
  args.request.splits = splits;
  for (uintptr_t h : inputs) args.inputs.push_back(reinterpret_cast<void*>(h));
  for (uintptr_t h : outputs) args.outputs.push_back(reinterpret_cast<void*>(h));
  args.dev_type = dev_type;
  args.dev_id = dev_id;
  args.priority = priority;
  ThrowIfError(PushCollective(runtime, std::move(args)));
}

// Negotiates a unit that moves no tensor data (a sizes round, barrier, join)
// and waits for it, the GIL released; returns (error message or None,
// response splits, response root). Ctrl-C interrupts the wait.
py::tuple Negotiate(int set_id, int type, const std::string& name, const std::vector<int>& dtypes,
                    const std::vector<std::vector<int64_t>>& shapes,
                    const std::vector<int64_t>& splits, bool sizes_only, int dev_type,
                    int dev_id) {
  std::shared_ptr<Runtime> runtime = RunningRuntime(set_id);
  if (static_cast<CollectiveType>(type) == CollectiveType::kJoin) {
    // Every collective called before join() must reach the coordinator first
    // (Runtime::AddInEngine).
    while (true) {
      {
        py::gil_scoped_release release;
        if (runtime->WaitNoneInEngine(std::chrono::milliseconds(100))) break;
      }
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    }
  }
  struct Outcome {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    Status status;
    Response response;
  };
  auto outcome = std::make_shared<Outcome>();
  TensorEntry entry;
  entry.request = MakeRequest(static_cast<CollectiveType>(type), name, dtypes, shapes, 1, 0, 1.0,
                              1.0, dev_type, dev_id, runtime->rank());
  entry.request.splits = splits;
  entry.request.sizes_only = sizes_only;
  entry.on_response = [outcome](const Response& response) { outcome->response = response; };
  entry.callback = [outcome](const Status& status) {
    std::lock_guard<std::mutex> lock(outcome->mu);
    outcome->status = status;
    outcome->done = true;
    outcome->cv.notify_all();
  };
  ThrowIfError(runtime->Enqueue(std::move(entry)));
  while (true) {
    {
      py::gil_scoped_release release;
      std::unique_lock<std::mutex> lock(outcome->mu);
      if (outcome->cv.wait_for(lock, std::chrono::milliseconds(100),
                               [&] { return outcome->done; })) {
        break;
      }
    }
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
  if (!outcome->status.ok()) {
    return py::make_tuple(outcome->status.message(), py::none(), 0);
  }
  return py::make_tuple(py::none(), outcome->response.splits, outcome->response.root);
}

// ---- test support ---------------------------------------------------------

DataType CheckedType(int code) {
  if (!IsSupportedDataType(code)) throw py::value_error("unsupported dtype code");
  return static_cast<DataType>(code);
}

void TestingReduceInto(py::array dst, py::array src, int dtype, int op, bool scalar) {
  DataType t = CheckedType(dtype);
  const int64_t count = dst.nbytes() / static_cast<int64_t>(DataTypeSize(t));
  if (src.nbytes() != dst.nbytes()) throw py::value_error("dst and src differ in size");
  void* d = dst.mutable_data();
  const void* s = src.data();
  if (scalar) {
    testing::ReduceIntoScalarForTest(d, s, count, t, static_cast<ReduceOp>(op));
  } else {
    ReduceInto(d, s, count, t, static_cast<ReduceOp>(op));
  }
}

void TestingScale(py::array buf, int dtype, double factor) {
  DataType t = CheckedType(dtype);
  ScaleBuffer(buf.mutable_data(), buf.nbytes() / static_cast<int64_t>(DataTypeSize(t)), t,
              factor);
}

// Runs RingAllreduce on LocalComm, one thread per array (= rank), in place.
void TestingRingAllreduce(std::vector<py::array> arrays, int dtype, int op,
                          int64_t segment_bytes) {
  DataType t = CheckedType(dtype);
  const int n = static_cast<int>(arrays.size());
  std::vector<void*> data;
  std::vector<int64_t> counts;
  for (auto& a : arrays) {
    data.push_back(a.mutable_data());
    counts.push_back(a.nbytes() / static_cast<int64_t>(DataTypeSize(t)));
  }
  py::gil_scoped_release release;
  auto world = std::make_shared<LocalWorld>(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      LocalComm comm(world, r);
      RingScratch scratch;
      RingAllreduce(comm, data[r], counts[r], t, static_cast<ReduceOp>(op), segment_bytes,
                    &scratch);
    });
  }
  for (auto& th : threads) th.join();
}

// ---- test support: the shared-memory allreduce ----------------------------

// Runs ShmAllreduce in one process, one thread per rank over plain memory:
// calls[c][r] is rank r's buffer in call c, reduced in place, calls in order.
// With hosts > 1, runs of size/hosts consecutive ranks are hosts, each with
// its own memory, and the ring over LocalComm joins them (hierarchical).
void TestingShmAllreduce(std::vector<std::vector<py::array>> calls, int dtype, int op,
                         int64_t chunk_bytes, int hosts) {
  DataType t = CheckedType(dtype);
  if (calls.empty()) return;
  const int n = static_cast<int>(calls[0].size());
  if (hosts < 1 || n % hosts != 0) throw py::value_error("hosts must divide the rank count");
  const int local = n / hosts;
  std::vector<std::vector<void*>> data(calls.size());
  std::vector<std::vector<int64_t>> counts(calls.size());
  for (size_t c = 0; c < calls.size(); ++c) {
    if (static_cast<int>(calls[c].size()) != n) throw py::value_error("one array per rank");
    for (auto& a : calls[c]) {
      data[c].push_back(a.mutable_data());
      counts[c].push_back(a.nbytes() / static_cast<int64_t>(DataTypeSize(t)));
    }
  }
  py::gil_scoped_release release;
  const int64_t region = ShmAllreduce::RegionBytes(chunk_bytes);
  std::vector<std::shared_ptr<std::vector<char>>> memory;
  std::vector<std::vector<char*>> regions(hosts);
  for (int h = 0; h < hosts; ++h) {
    memory.push_back(std::make_shared<std::vector<char>>(region * local + 64, 0));
    char* p = memory.back()->data();
    char* base = p + (64 - reinterpret_cast<uintptr_t>(p) % 64) % 64;
    for (int l = 0; l < local; ++l) regions[h].push_back(base + l * region);
  }
  std::vector<std::shared_ptr<LocalWorld>> cross_worlds;
  for (int l = 0; l < local; ++l) cross_worlds.push_back(std::make_shared<LocalWorld>(hosts));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      const int h = r / local, l = r % local;
      ShmAllreduce::CrossAllreduce cross;
      if (hosts > 1) {
        auto comm = std::make_shared<LocalComm>(cross_worlds[l], h);
        auto scratch = std::make_shared<RingScratch>();
        cross = [comm, scratch](void* buf, int64_t count, DataType dtype, ReduceOp op) {
          RingAllreduce(*comm, buf, count, dtype, op, 4096, scratch.get());
        };
      }
      ShmAllreduce shm(l, local, regions[h], chunk_bytes, memory[h], cross);
      for (size_t c = 0; c < calls.size(); ++c) {
        shm.Allreduce(data[c][r], counts[c][r], t, static_cast<ReduceOp>(op));
      }
    });
  }
  for (auto& th : threads) th.join();
}

// One call of a mixed sequence for TestingShmSequence.
struct ShmTestCall {
  std::string kind;           // allreduce, broadcast, allgather, alltoall
  std::vector<py::array> in;  // one per rank (allreduce, broadcast: in place)
  std::vector<py::array> out; // allgather, alltoall: one per rank
  std::vector<int64_t> ints;  // allreduce: dtype, op; broadcast: root;
                              // allgather: byte offsets; alltoall: byte matrix
};

// Runs a sequence of mixed ShmAllreduce calls in one process, one thread per
// rank over plain memory (one host), every rank making the same calls in
// the same order: interleaving must keep the chunk numbering in step.
void TestingShmSequence(const std::vector<py::tuple>& raw, int64_t chunk_bytes) {
  std::vector<ShmTestCall> calls;
  for (const py::tuple& t : raw) {
    calls.push_back({t[0].cast<std::string>(), t[1].cast<std::vector<py::array>>(),
                     t[2].cast<std::vector<py::array>>(), t[3].cast<std::vector<int64_t>>()});
  }
  if (calls.empty()) return;
  const int n = static_cast<int>(calls[0].in.size());
  std::vector<std::vector<char*>> in(calls.size()), out(calls.size());
  for (size_t c = 0; c < calls.size(); ++c) {
    if (static_cast<int>(calls[c].in.size()) != n) throw py::value_error("one input per rank");
    for (auto& a : calls[c].in) in[c].push_back(static_cast<char*>(a.mutable_data()));
    for (auto& a : calls[c].out) out[c].push_back(static_cast<char*>(a.mutable_data()));
    const std::string& k = calls[c].kind;
    if (k != "allreduce" && k != "broadcast" && k != "allgather" && k != "alltoall") {
      throw py::value_error("unknown kind " + k);
    }
  }
  py::gil_scoped_release release;
  const int64_t region = ShmAllreduce::RegionBytes(chunk_bytes);
  auto memory = std::make_shared<std::vector<char>>(region * n + 64, 0);
  char* base = memory->data() + (64 - reinterpret_cast<uintptr_t>(memory->data()) % 64) % 64;
  std::vector<char*> regions;
  for (int r = 0; r < n; ++r) regions.push_back(base + r * region);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      ShmAllreduce shm(r, n, regions, chunk_bytes, memory);
      for (size_t c = 0; c < calls.size(); ++c) {
        const ShmTestCall& call = calls[c];
        if (call.kind == "allreduce") {
          const DataType t = static_cast<DataType>(call.ints[0]);
          shm.Allreduce(in[c][r], call.in[r].nbytes() / static_cast<int64_t>(DataTypeSize(t)), t,
                        static_cast<ReduceOp>(call.ints[1]));
        } else if (call.kind == "broadcast") {
          shm.Broadcast(in[c][r], call.in[r].nbytes(), static_cast<int>(call.ints[0]));
        } else if (call.kind == "allgather") {
          shm.Allgather(in[c][r], out[c][r], call.ints);
        } else {
          shm.Alltoall(in[c][r], out[c][r], call.ints);
        }
      }
    });
  }
  for (auto& th : threads) th.join();
}

// The running runtime's shared-memory allreduce: None when off, else its
// allreduce calls and byte-moving calls so far, ranks per host and whether
// it is hierarchical.
py::object TestingShmInfo() {
  const ShmAllreduce* shm = RunningRuntime()->shm();
  if (shm == nullptr) return py::none();
  py::dict d;
  d["calls"] = shm->calls();
  d["local_size"] = shm->size();
  d["hierarchical"] = shm->hierarchical();
  d["exchanges"] = shm->exchanges();
  return d;
}

// ---- end of the shared-memory test support --------------------------------

// An EnvLookup over a map, for tests that pass their own environment.
EnvLookup MapLookup(const std::map<std::string, std::string>& env) {
  return [env](const std::string& name) -> std::optional<std::string> {
    auto it = env.find(name);
    if (it == env.end()) return std::nullopt;
    return it->second;
  };
}

py::dict TestingLoadConfig(const std::map<std::string, std::string>& env) {
  Config c;
  ThrowIfError(LoadConfig(MapLookup(env), &c));
  py::dict d;
  d["fusion_threshold"] = c.fusion_threshold;
  d["fusion_max_tensor_bytes"] = c.fusion_max_tensor_bytes;
  d["cycle_time_ms"] = c.cycle_time_ms;
  d["cache_capacity"] = c.cache_capacity;
  d["allreduce_algo"] = AllreduceAlgoName(c.allreduce_algo);
  d["ring_min_bytes"] = c.ring_min_bytes;
  d["ring_segment_bytes"] = c.ring_segment_bytes;
  d["shm_min_bytes"] = c.shm_min_bytes;
  d["shm_chunk_bytes"] = c.shm_chunk_bytes;
  d["hierarchical_allreduce"] = c.hierarchical_allreduce;
  d["testing_ranks_per_host"] = c.testing_ranks_per_host;
  d["log_level"] = static_cast<int>(c.log_level);
  d["stall_check_seconds"] = c.stall_check_seconds;
  d["stall_shutdown_seconds"] = c.stall_shutdown_seconds;
  d["timeline"] = c.timeline_path;
  d["timeline_mark_cycles"] = c.timeline_mark_cycles;
  d["autotune"] = c.autotune;
  d["autotune_log"] = c.autotune_log;
  d["fusion_threshold_fixed"] = c.fusion_threshold_fixed;
  d["cycle_time_fixed"] = c.cycle_time_fixed;
  d["allreduce_algo_fixed"] = c.allreduce_algo_fixed;
  return d;
}

// The fusion groups of a round of allreduce responses, each given as
// (dtype code, element counts of its tensors): lists of (response, tensor).
std::vector<std::vector<std::pair<int, int>>> TestingPlanFusion(
    const std::vector<std::pair<int, std::vector<int64_t>>>& responses, int64_t threshold,
    int64_t max_tensor_bytes) {
  std::vector<Response> round;
  for (const auto& spec : responses) {
    Response r;
    r.type = CollectiveType::kAllreduce;
    r.name = "t" + std::to_string(round.size());
    r.counts = spec.second;
    r.dtypes.assign(spec.second.size(), CheckedType(spec.first));
    round.push_back(std::move(r));
  }
  std::vector<std::vector<std::pair<int, int>>> out;
  for (const FusionGroup& group : PlanFusion(round, threshold, max_tensor_bytes)) {
    out.emplace_back();
    for (const FusionGroup::Item& item : group.items) {
      out.back().emplace_back(item.response, item.tensor);
    }
  }
  return out;
}

// Drives rank 0's Autotuner on a simulated clock: under the configuration
// `env` (as HVDMX_* variables), each round lasts 10 ms and moves
// throughput(fusion_threshold, cycle_time_ms, algorithm name) * 10 ms bytes
// under the setting the tuner wants at that moment. Returns the settings
// tried in order (the warm-up first) as (threshold, cycle, algorithm)
// tuples, the setting chosen, and the simulated seconds until the choice;
// chosen is None if none was made within an hour.
py::dict TestingAutotune(const std::map<std::string, std::string>& env, py::function throughput) {
  Config config;
  ThrowIfError(LoadConfig(MapLookup(env), &config));
  Autotuner tuner(config, /*leader=*/true);
  constexpr double kRoundSeconds = 0.01;
  auto now = Autotuner::Clock::time_point{};
  py::list tried;
  double seconds = 0;
  auto as_tuple = [](const TunedSetting& s) {
    return py::make_tuple(s.fusion_threshold, s.cycle_time_ms, AllreduceAlgoName(s.algo));
  };
  py::object last = py::none();
  for (; !tuner.done() && seconds < 3600; seconds += kRoundSeconds) {
    const TunedSetting s = tuner.current();
    py::tuple now_tuple = as_tuple(s);
    if (!now_tuple.equal(last)) {
      tried.append(now_tuple);
      last = now_tuple;
    }
    const double rate =
        throughput(s.fusion_threshold, s.cycle_time_ms, AllreduceAlgoName(s.algo)).cast<double>();
    now += std::chrono::duration_cast<Autotuner::Clock::duration>(
        std::chrono::duration<double>(kRoundSeconds));
    tuner.RoundDone(std::max<int64_t>(1, static_cast<int64_t>(rate * kRoundSeconds)), now);
  }
  py::dict d;
  d["tried"] = tried;
  d["seconds"] = seconds;
  d["chosen"] = tuner.done() ? py::object(as_tuple(tuner.current())) : py::object(py::none());
  return d;
}

// A whole job in one process: `size` runtimes over LocalComm, for testing
// negotiation, the cache and fusion without MPI. Arrays passed to submit
// must stay alive until wait() has returned for that ticket.
class LocalJob {
 public:
  LocalJob(int size, const std::map<std::string, std::string>& env) {
    Config config;
    ThrowIfError(LoadConfig(MapLookup(env), &config));
    auto control = std::make_shared<LocalWorld>(size);
    auto data = std::make_shared<LocalWorld>(size);
    for (int r = 0; r < size; ++r) {
      runtimes_.push_back(std::make_unique<Runtime>(std::make_unique<LocalComm>(control, r),
                                                    std::make_unique<LocalComm>(data, r),
                                                    config));
      runtimes_.back()->Start();
    }
  }
  ~LocalJob() { Shutdown(); }

  int64_t Submit(int rank, const std::string& kind, const std::string& name,
                 std::vector<py::array> inputs, std::vector<py::array> outputs, int dtype,
                 int op, int root, double prescale, double postscale) {
    Runtime& rt = *runtimes_.at(rank);
    TensorEntry entry;
    std::vector<int> dtypes;
    std::vector<std::vector<int64_t>> shapes;
    for (size_t i = 0; i < inputs.size(); ++i) {
      dtypes.push_back(dtype);
      shapes.emplace_back(inputs[i].shape(), inputs[i].shape() + inputs[i].ndim());
      entry.inputs.push_back(inputs[i].data());
      entry.outputs.push_back(outputs[i].mutable_data());
    }
    entry.request = MakeRequest(kind == "broadcast" ? CollectiveType::kBroadcast
                                                    : CollectiveType::kAllreduce,
                                name, dtypes, shapes, op, root, prescale, postscale, 1, 0, rank);
    const int64_t ticket = next_ticket_++;
    entry.callback = [this, ticket](const Status& status) {
      std::lock_guard<std::mutex> lock(mu_);
      done_[ticket] = status.ok() ? std::string() : "E:" + status.message();
      cv_.notify_all();
    };
    ThrowIfError(rt.Enqueue(std::move(entry)));
    return ticket;
  }

  // Returns None on success, the error message otherwise.
  py::object Wait(int64_t ticket, double timeout_s) {
    std::string result;
    {
      py::gil_scoped_release release;
      std::unique_lock<std::mutex> lock(mu_);
      if (!cv_.wait_for(lock, std::chrono::duration<double>(timeout_s),
                        [&] { return done_.count(ticket) > 0; })) {
        result = "T";
      } else {
        result = done_[ticket];
        done_.erase(ticket);
      }
    }
    if (result == "T") throw std::runtime_error("LocalJob.wait timed out");
    if (result.empty()) return py::none();
    return py::str(result.substr(2));
  }

  void Shutdown() {
    py::gil_scoped_release release;
    std::vector<std::thread> threads;
    for (auto& rt : runtimes_) threads.emplace_back([&rt] { rt->Shutdown(); });
    for (auto& th : threads) th.join();
  }

 private:
  std::vector<std::unique_ptr<Runtime>> runtimes_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<int64_t, std::string> done_;
  int64_t next_ticket_ = 0;
};

}  // namespace
}  // namespace hvdmx

PYBIND11_MODULE(_core, m) {
  using namespace hvdmx;
  m.doc() = "hvdmx's C++ core; use the hvdmx package, not this module.";

  m.def("mpi_built", [] { return true; });
  m.def("mpi_vendor", [] { return std::string(HVDMX_MPI_VENDOR); });
  m.def("nccl_built", [] { return HVDMX_NCCL_BUILT; });
  m.def("cuda_built", [] { return HVDMX_CUDA_BUILT != 0; });
  m.def("load_mxnet", [](const std::string& path) { ThrowIfError(LoadMXNetApi(path)); });

  m.def("ensure_default_layout",
        [](uintptr_t handle) { ThrowIfError(EnsureDefaultLayout(reinterpret_cast<void*>(handle))); });
  m.def("init", &Init, py::arg("comm_address") = 0);
  m.def("shutdown", &Shutdown);
  // False again once any rank has shut the job down (see Note [Shutdown]).
  m.def("is_initialized", [] {
    std::lock_guard<std::mutex> lock(G().mu);
    return Running();
  });
  m.def("stop_reason", [] {
    std::lock_guard<std::mutex> lock(G().mu);
    return G().runtime ? G().runtime->stop_reason() : std::string();
  });
  m.def("topology", [] {
    RunningRuntime();
    const Topology& t = G().topo;
    return py::make_tuple(t.rank, t.size, t.local_rank, t.local_size, t.cross_rank, t.cross_size);
  });
  m.def("mpi_threads_supported", [] {
    RunningRuntime();
    return G().thread_level >= MPI_THREAD_MULTIPLE;
  });
  // The timeline is rank 0's (as in Horovod): on other ranks these do nothing.
  m.def("start_timeline", [](const std::string& path, bool mark_cycles) {
    RunningRuntime();
    if (G().topo.rank != 0) return;
    py::gil_scoped_release release;
    ThrowIfError(ProcessTimeline().Start(path, mark_cycles));
  });
  m.def("stop_timeline", [] {
    py::gil_scoped_release release;
    ProcessTimeline().Stop();
  });
  m.def("add_process_set", &AddProcessSet);
  m.def("remove_process_set", &RemoveProcessSet);
  m.def("process_set_ids", [] {
    std::lock_guard<std::mutex> lock(G().mu);
    std::vector<int> ids{0};
    for (const auto& kv : G().set_ranks) ids.push_back(kv.first);
    return ids;
  });
  // Collective types, as the Python layer passes them.
  m.attr("ALLREDUCE") = static_cast<int>(CollectiveType::kAllreduce);
  m.attr("BROADCAST") = static_cast<int>(CollectiveType::kBroadcast);
  m.attr("ALLGATHER") = static_cast<int>(CollectiveType::kAllgather);
  m.attr("ALLTOALL") = static_cast<int>(CollectiveType::kAlltoall);
  m.attr("REDUCESCATTER") = static_cast<int>(CollectiveType::kReducescatter);
  m.attr("BARRIER") = static_cast<int>(CollectiveType::kBarrier);
  m.attr("JOIN") = static_cast<int>(CollectiveType::kJoin);
  m.def("push_async", &PushAsync);
  m.def("negotiate", &Negotiate);
  m.def("push_failure", [](const std::vector<uintptr_t>& outputs, const std::string& message,
                           int dev_type, int dev_id) {
    std::vector<void*> handles;
    for (uintptr_t h : outputs) handles.push_back(reinterpret_cast<void*>(h));
    ThrowIfError(PushFailure(handles, message, dev_type, dev_id));
  });

  m.def("_testing_reduce_into", &TestingReduceInto);
  m.def("_testing_scale", &TestingScale);
  m.def("_testing_ring_allreduce", &TestingRingAllreduce);
  m.def("_testing_load_config", &TestingLoadConfig);
  m.def("_testing_autotune", &TestingAutotune);
  m.def("_testing_plan_fusion", &TestingPlanFusion);
  m.def("_testing_shm_allreduce", &TestingShmAllreduce, py::arg("calls"), py::arg("dtype"),
        py::arg("op"), py::arg("chunk_bytes"), py::arg("hosts") = 1);
  m.def("_testing_shm_sequence", &TestingShmSequence, py::arg("calls"), py::arg("chunk_bytes"));
  m.def("_testing_shm_slice_start", &ShmSliceStart);
  m.def("_testing_shm_info", &TestingShmInfo);
  py::class_<LocalJob>(m, "_TestingLocalJob")
      .def(py::init<int, const std::map<std::string, std::string>&>())
      .def("submit", &LocalJob::Submit)
      .def("wait", &LocalJob::Wait)
      .def("shutdown", &LocalJob::Shutdown);
}
