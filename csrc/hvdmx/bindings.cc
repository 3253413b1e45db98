// Thin pybind11 bindings: the module hvdmx._core. Maps Status to Python
// exceptions, releases the GIL around anything that waits, and holds the one
// process-wide Runtime. Functions whose names start with _testing exist for
// the test suite only; most are defined in testing_bindings.cc.
#include <mpi.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "env_config.h"
#include "logging.h"
#include "mpi_comm.h"
#include "mxnet_engine.h"
#include "output_pool.h"
#include "runtime.h"
#include "timeline.h"
#include "shm_allreduce.h"
#include "shm_segment.h"
#include "testing_bindings.h"

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

void ThrowIfError(const Status& status) {
  if (status.ok()) return;
  if (status.code() == Status::Code::kInvalidArgument) throw py::value_error(status.message());
  throw std::runtime_error(status.message());
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

namespace {

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
      {"FUSION_PIECE_BYTES", c.fusion_piece_bytes},
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

// How long a thread waiting for a sizes round polls before it sleeps.
constexpr int64_t kNegotiateSpinMicros = 50;

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
    std::atomic<bool> done{false};
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
    outcome->done.store(true, std::memory_order_release);
    outcome->cv.notify_all();
  };
  ThrowIfError(runtime->Enqueue(std::move(entry)));
  {
    // A sizes round usually completes within tens of microseconds (the peers
    // make the same call at about the same time): poll that long before
    // sleeping, sparing the wake-up. The lock below orders the reads.
    py::gil_scoped_release release;
    const auto until =
        std::chrono::steady_clock::now() + std::chrono::microseconds(kNegotiateSpinMicros);
    while (!outcome->done.load(std::memory_order_acquire) &&
           std::chrono::steady_clock::now() < until) {
      std::this_thread::yield();
    }
  }
  while (true) {
    {
      py::gil_scoped_release release;
      std::unique_lock<std::mutex> lock(outcome->mu);
      if (outcome->cv.wait_for(lock, std::chrono::milliseconds(100),
                               [&] { return outcome->done.load(); })) {
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

// Test support that needs the running runtime; the rest is in
// testing_bindings.cc.

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
  d["bit_ands"] = shm->bit_ands();
  return d;
}

int64_t TestingFusionBufferBytes() { return RunningRuntime()->fusion_buffer_bytes(); }

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
  m.def("describe", [](uintptr_t handle) {
    ArrayInfo info;
    ThrowIfError(DescribeArray(reinterpret_cast<void*>(handle), &info));
    py::object shape = py::none();
    if (info.ndim >= 0) shape = py::tuple(py::cast(info.shape));
    return py::make_tuple(info.dtype, info.stype, info.dev_type, info.dev_id, shape);
  });
  m.def("new_array", [](const std::vector<int64_t>& shape, int dtype, int dev_type, int dev_id) {
    void* handle = nullptr;
    ThrowIfError(NewArray(shape, dtype, dev_type, dev_id, &handle));
    return reinterpret_cast<uintptr_t>(handle);
  });
  m.def("new_int32_array", [](const std::vector<int64_t>& values) {
    void* handle = nullptr;
    ThrowIfError(NewInt32Array(values, &handle));
    return reinterpret_cast<uintptr_t>(handle);
  });
  m.def("push_async", &PushAsync);
  m.def("negotiate", &Negotiate);
  m.def("push_failure", [](const std::vector<uintptr_t>& outputs, const std::string& message,
                           int dev_type, int dev_id) {
    std::vector<void*> handles;
    for (uintptr_t h : outputs) handles.push_back(reinterpret_cast<void*>(h));
    ThrowIfError(PushFailure(handles, message, dev_type, dev_id));
  });

  m.def("_testing_shm_info", &TestingShmInfo);
  m.def("_testing_fusion_buffer_bytes", &TestingFusionBufferBytes);
  DefineTestingBindings(m);
}
