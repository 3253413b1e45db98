// Thin pybind11 bindings: the module hvdmx._core. Maps Status to Python
// exceptions (ThrowIfError, bindings_support.h) and releases the GIL around
// anything that waits; the job itself (init, shutdown, process sets, how its
// comms are wired) is job/'s. The test suite's own entry points are in another module
// (testing/testing_module.cc), which _core does not contain.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "algorithms/onebit.h"
#include "algorithms/twobit.h"
#include "base/timeline.h"
#include "bench/scale_harness.h"
#include "comm/group.h"
#include "comm/mpi_library.h"
#include "job/job.h"
#include "mxnet/mxnet_engine.h"
#include "platform/cpu_binding.h"
#include "platform/output_pool.h"
#include "platform/stage_stores.h"
#include "python/bindings_support.h"
#include "runtime/runtime.h"
#include "shm/host_tree_comm.h"
#include "shm/shm_control_comm.h"
#include "shm/shm_host.h"

#ifndef HVDMX_NCCL_BUILT
#define HVDMX_NCCL_BUILT 0
#endif
#ifndef HVDMX_CUDA_BUILT
#define HVDMX_CUDA_BUILT 0
#endif

namespace py = pybind11;

namespace hvdmx {

namespace {

// The runtime of process set `set_id` (0: the global set), or the error
// RunningRuntime returns, raised.
std::shared_ptr<Runtime> RuntimeOrRaise(int set_id = 0) {
  std::shared_ptr<Runtime> runtime;
  ThrowIfError(RunningRuntime(set_id, &runtime));
  return runtime;
}

// A Group whose calls go to a Python object, the launcher's rendezvous in a
// job started without MPI (hvdmx.rendezvous.client.StoreGroup): attributes `rank`
// and `size`, `allgather(bytes) -> list of bytes` and `split(color, key) ->
// group or None`. Init runs without the GIL, so every call takes it; an
// error the object raises (the rendezvous timed out, naming the ranks
// missing) reaches init's caller as it is.
class PyGroup : public Group {
 public:
  // With the GIL held.
  explicit PyGroup(py::object group) : group_(std::move(group)) {
    rank_ = group_.attr("rank").cast<int>();
    size_ = group_.attr("size").cast<int>();
    if (size_ < 1 || rank_ < 0 || rank_ >= size_) {
      throw py::value_error("hvdmx.init: the job's group says rank " + std::to_string(rank_) +
                            " of " + std::to_string(size_) + "; a rank is in [0, size)");
    }
  }
  ~PyGroup() override {
    if (!Py_IsInitialized()) {
      group_.release();  // the interpreter is gone: nothing to hand back
      return;
    }
    py::gil_scoped_acquire gil;
    group_ = py::object();
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  std::vector<std::string> Allgather(const std::string& mine) override {
    py::gil_scoped_acquire gil;
    py::list all = group_.attr("allgather")(py::bytes(mine));
    if (static_cast<int>(all.size()) != size_) {
      throw std::runtime_error("hvdmx.init: the rendezvous answered an allgather with " +
                               std::to_string(all.size()) + " entries for a group of " +
                               std::to_string(size_));
    }
    std::vector<std::string> out;
    out.reserve(all.size());
    for (const py::handle& item : all) out.push_back(item.cast<std::string>());
    return out;
  }

  std::unique_ptr<Group> Split(int color, int key) override {
    py::gil_scoped_acquire gil;
    py::object sub = group_.attr("split")(color, key);
    if (sub.is_none()) return nullptr;
    return std::make_unique<PyGroup>(std::move(sub));
  }

 private:
  py::object group_;
  int rank_ = 0;
  int size_ = 1;
};

// The arguments every collective's binding takes by keyword (CollectiveArgs
// but for the set and the arrays), in the order of the binding's signature.
CollectiveArgs Collective(int type, const std::string& name, const std::vector<int>& dtypes,
                          const std::vector<std::vector<int64_t>>& shapes, int op, int root,
                          double prescale, double postscale, const std::vector<int64_t>& splits,
                          int dev_type, int dev_id) {
  CollectiveArgs c;
  c.type = static_cast<CollectiveType>(type);
  c.name = name;
  c.dtypes = dtypes;
  c.shapes = shapes;
  c.op = op;
  c.root = root;
  c.scale = Scale{prescale, postscale};
  c.splits = splits;
  c.dev_type = dev_type;
  c.dev_id = dev_id;
  return c;
}

void PushAsync(int set_id, const CollectiveArgs& call, const std::vector<uintptr_t>& inputs,
               const std::vector<uintptr_t>& outputs, int priority) {
  std::shared_ptr<Runtime> runtime = RuntimeOrRaise(set_id);
  PushArgs args;
  args.request = MakeRequest(call, runtime->rank());
  for (uintptr_t h : inputs) args.inputs.push_back(reinterpret_cast<void*>(h));
  for (uintptr_t h : outputs) args.outputs.push_back(reinterpret_cast<void*>(h));
  args.dev_type = call.dev_type;
  args.dev_id = call.dev_id;
  args.priority = priority;
  ThrowIfError(PushCollective(runtime, std::move(args)));
}

// A compression kernel's pack as an engine op: reads `gradient`, updates
// `residual` and writes `packed` (see onebit.h, twobit.h).
void PushPack(uintptr_t gradient, uintptr_t residual, uintptr_t packed, const char* op_name,
              std::function<void(const float*, float*, uint32_t*)> kernel) {
  ThrowIfError(PushCompute(
      {reinterpret_cast<void*>(gradient)},
      {reinterpret_cast<void*>(residual), reinterpret_cast<void*>(packed)},
      [kernel](const std::vector<const void*>& in, const std::vector<void*>& out) {
        kernel(static_cast<const float*>(in[0]), static_cast<float*>(out[0]),
               static_cast<uint32_t*>(out[1]));
        return Status::Ok();
      },
      op_name));
}

// Its unpack: reads every rank's `packed` words, writes their sum to `out`.
void PushUnpackSum(uintptr_t packed, uintptr_t out, const char* op_name,
                   std::function<void(const uint32_t*, float*)> kernel) {
  ThrowIfError(PushCompute(
      {reinterpret_cast<void*>(packed)}, {reinterpret_cast<void*>(out)},
      [kernel](const std::vector<const void*>& in, const std::vector<void*>& outs) {
        kernel(static_cast<const uint32_t*>(in[0]), static_cast<float*>(outs[0]));
        return Status::Ok();
      },
      op_name));
}

// What a collective refuses in an NDArray argument, in the order checked
// (CheckArray); hvdmx/ops.py words each as an error (_array_error).
enum ArrayProblem : int {
  kArrayOk = 0,
  kArraySparse = 1,     // not dense
  kArrayDtype = 2,      // a dtype the collectives do not take (IsArrayDtype)
  kArrayNeedsCuda = 3,  // on a GPU, and this build has no CUDA
  kArrayNoShape = 4,    // its shape is not known yet
};

// The dtypes the collectives take from an NDArray: DataType's codes float32
// to int64 (0 to 6), not bfloat16.
bool IsArrayDtype(int code) { return code >= 0 && code <= 6; }

// The one check of an NDArray argument: what describe() reports to
// ops.py for every collective, and what PushAllreduceEach checks itself.
ArrayProblem CheckArray(const ArrayInfo& a) {
  if (a.stype != 0) return kArraySparse;
  if (!IsArrayDtype(a.dtype)) return kArrayDtype;
  if (a.dev_type == 2 && HVDMX_CUDA_BUILT == 0) return kArrayNeedsCuda;
  if (a.ndim < 0) return kArrayNoShape;
  return kArrayOk;
}

// One in-place allreduce per tensor, each its own unit and engine op, as
// allreduce_ pushes it: the gradients of DistributedTrainer in one call
// instead of one Python call each. Every tensor is checked (CheckArray)
// before any is pushed; returns (-1, kArrayOk), or the index of the first
// that allreduce_ refuses and why, for the Python layer to raise
// allreduce_'s own error.
std::pair<int, int> PushAllreduceEach(int set_id, const std::vector<std::string>& names,
                                      const std::vector<uintptr_t>& handles,
                                      const std::vector<int>& priorities, int op, Scale scale) {
  if (names.size() != handles.size() || priorities.size() != handles.size()) {
    throw py::value_error("push_allreduce_each: one name and one priority per tensor");
  }
  std::shared_ptr<Runtime> runtime = RuntimeOrRaise(set_id);
  std::vector<ArrayInfo> infos(handles.size());
  for (size_t i = 0; i < handles.size(); ++i) {
    ThrowIfError(DescribeArray(reinterpret_cast<void*>(handles[i]), &infos[i]));
    const ArrayProblem problem = CheckArray(infos[i]);
    if (problem != kArrayOk) return {static_cast<int>(i), problem};
  }
  for (size_t i = 0; i < handles.size(); ++i) {
    const ArrayInfo& a = infos[i];
    void* handle = reinterpret_cast<void*>(handles[i]);
    CollectiveArgs call;
    call.type = CollectiveType::kAllreduce;
    call.name = names[i];
    call.dtypes = {a.dtype};
    call.shapes = {a.shape};
    call.op = op;
    call.scale = scale;
    call.dev_type = a.dev_type;
    call.dev_id = a.dev_id;
    PushArgs args;
    args.request = MakeRequest(call, runtime->rank());
    args.inputs.push_back(handle);
    args.outputs.push_back(handle);
    args.dev_type = a.dev_type;
    args.dev_id = a.dev_id;
    args.priority = priorities[i];
    ThrowIfError(PushCollective(runtime, std::move(args)));
  }
  return {-1, kArrayOk};
}

// How long a thread waiting for a sizes round polls before it sleeps.
constexpr int64_t kNegotiateSpinMicros = 50;

// Negotiates a unit that moves no tensor data (a sizes round, barrier, join)
// and waits for it, the GIL released; returns (error message or None,
// response splits, response root, Status::Code: MISMATCH when the error is
// the round's error response, which every rank of the call gets in that same
// round). Ctrl-C interrupts the wait.
py::tuple Negotiate(int set_id, const CollectiveArgs& call) {
  std::shared_ptr<Runtime> runtime = RuntimeOrRaise(set_id);
  if (call.type == CollectiveType::kJoin) {
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
  entry.request = MakeRequest(call, runtime->rank());
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
    return py::make_tuple(outcome->status.message(), py::none(), 0,
                          static_cast<int>(outcome->status.code()));
  }
  return py::make_tuple(py::none(), outcome->response.splits, outcome->response.root,
                        static_cast<int>(Status::Code::kOk));
}

// The running runtime's entries of Stats().
void AddRuntimeStats(const Runtime& runtime, py::dict& d) {
  py::object shm_stats = py::none();
  if (const ShmHost* shm = runtime.shm()) {
    const ShmStats stats = shm->stats();
    py::dict s;
    s["calls"] = stats.calls;
    s["local_size"] = shm->size();
    s["hierarchical"] = shm->hierarchical();
    s["exchanges"] = stats.exchanges;
    s["direct_exchanges"] = stats.direct_exchanges;
    s["root_writes"] = stats.root_writes;
    s["writes_into_peers"] = shm->exchange().writes_into_peers();
    s["push_exchanges"] = stats.push_exchanges;
    s["direct_min_bytes"] = DirectMinBytesValue(shm->exchange().direct_min_bytes());
    s["collapsed_huge_pages"] = stats.collapsed_huge_pages;
    s["refused_huge_pages"] = stats.refused_huge_pages;
    s["streamed_calls"] = stats.streamed_calls;
    s["streaming_stores"] = StageStoresName(shm->stage_stores());
    s["bit_ands"] = stats.bit_ands;
    shm_stats = s;
  }
  d["shm"] = shm_stats;
  // Slow-path rounds whose requests went with the bit-and and those that
  // gathered them, the allreduces completed inside rounds (Note [Small
  // tensors in the round]), and the strings (rank 0's responses) broadcast through
  // shared memory (-1 without it).
  py::dict negotiation;
  negotiation["sent_with_bit_and"] = runtime.controller().sent_with_bit_and();
  negotiation["gathered"] = runtime.controller().gathered();
  negotiation["reduced_in_round"] = runtime.controller().reduced_in_round();
  negotiation["strings_broadcast"] =
      runtime.shm() == nullptr ? -1 : runtime.shm()->stats().strings_broadcast;
  // How rounds reach the other ranks, and the messages this rank has sent
  // and received for them over the network (-1 where MPI carries them).
  const ControlComm& control = runtime.control();
  const P2PComm* network = nullptr;
  std::string scheme = "mpi";
  int64_t messages = -1;
  if (const auto* tree = dynamic_cast<const HostTreeComm*>(&control)) {
    scheme = "host tree";
    network = tree->leaders();
    messages = 0;
  } else if (dynamic_cast<const ShmControlComm*>(&control) != nullptr) {
    scheme = "shared memory";
  } else if (const auto* p2p = dynamic_cast<const P2PComm*>(&control)) {
    scheme = p2p->BitAndPayloadCapacity() > 0 ? "direct" : "doubling";
    network = p2p;
  }
  if (network != nullptr) {
    const Traffic traffic = network->traffic();
    messages = traffic.sent_messages + traffic.received_messages;
  }
  negotiation["scheme"] = scheme;
  negotiation["network_messages"] = messages;
  d["negotiation"] = negotiation;
  d["fusion_buffer_bytes"] = runtime.fusion_buffer_bytes();
  const HugePageCollapser& pages = runtime.mpi_pages();
  py::dict mpi_pages;
  mpi_pages["enabled"] = pages.enabled();
  mpi_pages["collapsed"] = pages.collapsed();
  mpi_pages["refused"] = pages.refused();
  d["mpi_huge_pages"] = mpi_pages;
}

// What the running job has done so far, for diagnosis and for the tests
// (one dict, read at once): the global set's shared-memory collectives (None
// when off), its negotiation, its fusion buffer and its collapsing of
// MPI's buffers into huge pages, and the process's output pool and CPU
// binding. Counters only grow while a runtime runs. Before hvd.init() and
// after shutdown, only the process's entries are there.
py::dict Stats() {
  py::dict d;
  std::shared_ptr<Runtime> rt;
  if (RunningRuntime(0, &rt).ok()) AddRuntimeStats(*rt, d);
  const OutputPool::Stats p = OutputPool::Get().stats();
  py::dict pool;
  pool["limit"] = p.limit;
  pool["kept_bytes"] = p.kept_bytes;
  pool["kept_blocks"] = p.kept_blocks;
  pool["out_bytes"] = p.out_bytes;
  pool["reused"] = p.reused;
  pool["mapped"] = p.mapped;
  pool["arena_used"] = p.arena_used;
  pool["min_bytes"] = OutputPool::kMinBytes;
  d["output_pool"] = pool;
  // The CPU hvd.init() bound this process to (-1: none) and the CPUs the
  // shared-memory waits count.
  py::dict cpu;
  cpu["cpu"] = BoundCpu();
  cpu["usable_cpus"] = UsableCpuCount();
  d["cpu_binding"] = cpu;
  return d;
}

}  // namespace
}  // namespace hvdmx

PYBIND11_MODULE(_core, m) {
  using namespace hvdmx;
  m.doc() = "hvdmx's C++ core; use the hvdmx package, not this module.";

  m.def("mpi_built", [] { return true; });
  // The MPI the loaded plugin was built against; "" before load_mpi.
  m.def("mpi_vendor", [] { return MpiPluginVendor(); });
  m.def("load_mpi", [](const std::string& path) {
    std::string vendor;
    ThrowIfError(LoadMpiPlugin(path, &vendor));
    return vendor;
  });
  m.def("nccl_built", [] { return HVDMX_NCCL_BUILT; });
  m.def("cuda_built", [] { return HVDMX_CUDA_BUILT != 0; });
  m.def("load_mxnet", [](const std::string& path) { ThrowIfError(LoadMXNetApi(path)); });

  m.def("ensure_default_layout", [](uintptr_t handle) {
    ThrowIfError(EnsureDefaultLayout(reinterpret_cast<void*>(handle)));
  });
  m.def(
      "init",
      [](uintptr_t comm_address) {
        Status status;
        {
          py::gil_scoped_release release;
          status = InitStatus([&] { return Init(comm_address); });
        }
        ThrowIfError(status);
      },
      py::arg("comm_address") = 0);
  m.def("init_group", [](py::object group) {
    auto world = std::make_unique<PyGroup>(std::move(group));
    Status status;
    {
      py::gil_scoped_release release;
      status = InitStatus([&] { return InitOver(std::move(world)); });
    }
    ThrowIfError(status);
  });
  m.def("shutdown", &Shutdown, py::call_guard<py::gil_scoped_release>());
  // Every host's ranks, hosts in the order of their lowest rank.
  m.def("hosts", [] {
    std::vector<std::vector<int>> hosts;
    ThrowIfError(JobHosts(&hosts));
    return hosts;
  });
  // False again once any rank has shut the job down (see Note [Shutdown]).
  m.def("is_initialized", [] { return JobRunning(); });
  // (code, message): why the global runtime stopped when this rank's
  // shutdown did not stop it alone (Runtime::stop_status), or (STATUS_OK, "")
  // while it runs, before init and after this rank's shutdown. The Python
  // layer decides by the code (hvdmx/_job.py).
  m.def("stop_status", [] {
    const Status status = JobStopStatus();
    return py::make_tuple(static_cast<int>(status.code()), status.message());
  });
  // HVDMX_STALL_SHUTDOWN_TIME_SECONDS as the last hvd.init() read it (0: off,
  // and before the first init): the core is the one reader of the settings.
  m.def("stall_shutdown_seconds", [] { return JobStallShutdownSeconds(); });
  m.def("topology", [] {
    bool thread_multiple = false;
    Topology t;
    ThrowIfError(JobTopology(&t, &thread_multiple));
    return py::make_tuple(t.rank, t.size, t.local_rank, t.local_size, t.cross_rank, t.cross_size,
                          thread_multiple);
  });
  // The timeline is rank 0's (as in Horovod): on other ranks these do nothing.
  m.def("start_timeline", [](const std::string& path, bool mark_cycles) {
    RuntimeOrRaise();
    Topology t;
    bool thread_multiple = false;
    ThrowIfError(JobTopology(&t, &thread_multiple));
    if (t.rank != 0) return;
    py::gil_scoped_release release;
    ThrowIfError(ProcessTimeline().Start(path, mark_cycles));
  });
  m.def("stop_timeline", [] {
    py::gil_scoped_release release;
    ProcessTimeline().Stop();
  });
  m.def("add_process_set", [](const std::vector<int>& ranks, bool same_everywhere) {
    int id = 0;
    Status status;
    {
      py::gil_scoped_release release;
      status = AddProcessSet(ranks, same_everywhere, &id);
    }
    ThrowIfError(status);
    return id;
  });
  m.def("remove_process_set", [](int id) {
    Status status;
    {
      py::gil_scoped_release release;
      status = RemoveProcessSet(id);
    }
    ThrowIfError(status);
  });
  m.def("process_set_ids", &JobProcessSetIds);
  // Collective types, as the Python layer passes them.
  m.attr("ALLREDUCE") = static_cast<int>(CollectiveType::kAllreduce);
  m.attr("BROADCAST") = static_cast<int>(CollectiveType::kBroadcast);
  m.attr("ALLGATHER") = static_cast<int>(CollectiveType::kAllgather);
  m.attr("ALLTOALL") = static_cast<int>(CollectiveType::kAlltoall);
  m.attr("REDUCESCATTER") = static_cast<int>(CollectiveType::kReducescatter);
  m.attr("BARRIER") = static_cast<int>(CollectiveType::kBarrier);
  m.attr("JOIN") = static_cast<int>(CollectiveType::kJoin);
  AddStatusCodes(m);
  // The dtype and reduction op codes (base/common.h) by name: the one list
  // that hvdmx/ops.py and the tests read. DTYPE_CODES has every DataType,
  // ARRAY_DTYPES the names of those the collectives take from an NDArray.
  py::dict dtype_codes;
  py::list array_dtypes;
  for (DataType t : {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16, DataType::kUInt8,
                     DataType::kInt32, DataType::kInt8, DataType::kInt64, DataType::kBFloat16}) {
    dtype_codes[py::str(DataTypeName(t))] = static_cast<int>(t);
    if (IsArrayDtype(static_cast<int>(t))) array_dtypes.append(py::str(DataTypeName(t)));
  }
  m.attr("DTYPE_CODES") = dtype_codes;
  m.attr("ARRAY_DTYPES") = py::tuple(array_dtypes);
  py::dict reduce_ops;
  for (ReduceOp op : {ReduceOp::kAverage, ReduceOp::kSum, ReduceOp::kAdasum, ReduceOp::kMin,
                      ReduceOp::kMax, ReduceOp::kProduct}) {
    reduce_ops[py::str(ReduceOpName(op))] = static_cast<int>(op);
  }
  m.attr("REDUCE_OPS") = reduce_ops;
  // What describe() and push_allreduce_each() report about an array (CheckArray).
  m.attr("ARRAY_OK") = static_cast<int>(kArrayOk);
  m.attr("ARRAY_SPARSE") = static_cast<int>(kArraySparse);
  m.attr("ARRAY_DTYPE") = static_cast<int>(kArrayDtype);
  m.attr("ARRAY_NEEDS_CUDA") = static_cast<int>(kArrayNeedsCuda);
  m.attr("ARRAY_NO_SHAPE") = static_cast<int>(kArrayNoShape);
  m.def("describe", [](uintptr_t handle) {
    ArrayInfo info;
    ThrowIfError(DescribeArray(reinterpret_cast<void*>(handle), &info));
    py::object shape = py::none();
    if (info.ndim >= 0) shape = py::tuple(py::cast(info.shape));
    return py::make_tuple(info.dtype, info.stype, info.dev_type, info.dev_id, shape,
                          static_cast<int>(CheckArray(info)));
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
  // The collectives take their arguments by keyword only, each named at the
  // call (hvdmx/ops.py); defaults are those of a unit that reduces nothing.
  constexpr int kSum = static_cast<int>(ReduceOp::kSum);
  m.def(
      "push_async",
      [](int set_id, int collective, const std::string& name, const std::vector<uintptr_t>& inputs,
         const std::vector<uintptr_t>& outputs, const std::vector<int>& dtypes,
         const std::vector<std::vector<int64_t>>& shapes, int op, int root, double prescale,
         double postscale, const std::vector<int64_t>& splits, int priority, int dev_type,
         int dev_id) {
        PushAsync(set_id,
                  Collective(collective, name, dtypes, shapes, op, root, prescale, postscale,
                             splits, dev_type, dev_id),
                  inputs, outputs, priority);
      },
      py::kw_only(), py::arg("set_id"), py::arg("collective"), py::arg("name"), py::arg("inputs"),
      py::arg("outputs"), py::arg("dtypes"), py::arg("shapes"), py::arg("op") = kSum,
      py::arg("root") = 0, py::arg("prescale") = 1.0, py::arg("postscale") = 1.0,
      py::arg("splits") = std::vector<int64_t>{}, py::arg("priority") = 0, py::arg("dev_type") = 1,
      py::arg("dev_id") = 0);
  m.def(
      "push_allreduce_each",
      [](int set_id, const std::vector<std::string>& names, const std::vector<uintptr_t>& handles,
         const std::vector<int>& priorities, int op, double prescale, double postscale) {
        return PushAllreduceEach(set_id, names, handles, priorities, op,
                                 Scale{prescale, postscale});
      },
      py::kw_only(), py::arg("set_id"), py::arg("names"), py::arg("handles"), py::arg("priorities"),
      py::arg("op"), py::arg("prescale") = 1.0, py::arg("postscale") = 1.0);
  m.def(
      "negotiate",
      [](int set_id, int collective, const std::string& name, const std::vector<int>& dtypes,
         const std::vector<std::vector<int64_t>>& shapes, const std::vector<int64_t>& splits,
         bool sizes_only, int dev_type, int dev_id) {
        CollectiveArgs call = Collective(collective, name, dtypes, shapes, kSum, 0, 1.0, 1.0,
                                         splits, dev_type, dev_id);
        call.sizes_only = sizes_only;
        return Negotiate(set_id, call);
      },
      py::kw_only(), py::arg("set_id"), py::arg("collective"), py::arg("name"),
      py::arg("dtypes") = std::vector<int>{},
      py::arg("shapes") = std::vector<std::vector<int64_t>>{},
      py::arg("splits") = std::vector<int64_t>{}, py::arg("sizes_only") = false,
      py::arg("dev_type") = 1, py::arg("dev_id") = 0);
  // One-bit compression (onebit.h) and MXNet's 2-bit (twobit.h), as engine
  // ops on float32 arrays on the CPU.
  m.def("onebit_pack", [](uintptr_t gradient, uintptr_t residual, uintptr_t packed, int64_t n) {
    PushPack(gradient, residual, packed, "hvdmx_onebit_pack",
             [n](const float* g, float* r, uint32_t* p) { OneBitPack(g, r, n, p); });
  });
  m.def("onebit_unpack_sum", [](uintptr_t packed, int ranks, uintptr_t out, int64_t n) {
    PushUnpackSum(packed, out, "hvdmx_onebit_unpack_sum",
                  [ranks, n](const uint32_t* p, float* o) { OneBitUnpackSum(p, ranks, n, o); });
  });
  m.def("onebit_words", &OneBitPackedWords);
  m.def("twobit_pack",
        [](uintptr_t gradient, uintptr_t residual, uintptr_t packed, int64_t n, float threshold) {
          PushPack(gradient, residual, packed, "hvdmx_twobit_pack",
                   [n, threshold](const float* g, float* r, uint32_t* p) {
                     TwoBitPack(g, r, n, threshold, p);
                   });
        });
  m.def("twobit_unpack_sum", [](uintptr_t packed, int ranks, uintptr_t out, int64_t n) {
    PushUnpackSum(packed, out, "hvdmx_twobit_unpack_sum",
                  [ranks, n](const uint32_t* p, float* o) { TwoBitUnpackSum(p, ranks, n, o); });
  });
  m.def("twobit_words", &TwoBitPackedWords);
  m.def("all_idle", &AllIdle, py::call_guard<py::gil_scoped_release>());
  // "tcp" or "mpi": how the ranks of process set `set_id` talk (HVDMX_TRANSPORT).
  m.def(
      "transport",
      [](int set_id) { return std::string(TransportName(RuntimeOrRaise(set_id)->transport())); },
      py::arg("set_id") = 0);
  // Ends the process with status 1 after `seconds`, writing `message` to
  // stderr first, unless it has exited by then: a bound on MPI_Finalize's
  // wait for peers that may be gone (hvdmx/basics.py). A native thread, so
  // that it fires even while the interpreter is finalizing.
  m.def("exit_after", [](double seconds, const std::string& message) {
    std::thread([seconds, message] {
      std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
      ssize_t ignored = write(2, message.data(), message.size());
      (void)ignored;
      _exit(1);
    }).detach();
  });
  m.def("stats", &Stats);
  // The scale harness (bench/scale_harness.h), for hvdmx/bench/scale.py.
  m.def(
      "scale",
      [](int ranks, int per_host, bool host_tree, int rounds, int requests,
         std::vector<int64_t> step_counts, int steps) {
        ScaleOptions o;
        o.ranks = ranks;
        o.per_host = per_host;
        o.host_tree = host_tree;
        o.rounds = rounds;
        o.requests = requests;
        o.step_counts = std::move(step_counts);
        o.steps = steps;
        ScaleResult got;
        try {
          py::gil_scoped_release release;
          got = RunScale(o);
        } catch (const std::invalid_argument& e) {
          throw py::value_error(e.what());
        }
        py::list ranks_out;
        for (const ScaleRank& r : got.ranks) {
          py::dict d;
          d["error"] = r.error;
          d["sent_messages"] = r.sent_messages;
          d["received_messages"] = r.received_messages;
          d["sent_bytes"] = r.sent_bytes;
          d["received_bytes"] = r.received_bytes;
          d["cpu_seconds"] = r.cpu_seconds;
          d["hops"] = r.hops;
          d["links"] = r.links;
          ranks_out.append(d);
        }
        py::dict out;
        out["ranks"] = ranks_out;
        out["round_seconds"] = got.round_seconds;
        out["uncached_seconds"] = got.uncached_seconds;
        out["step_seconds"] = got.step_seconds;
        out["step_correct"] = got.step_correct;
        return out;
      },
      py::kw_only(), py::arg("ranks"), py::arg("per_host"), py::arg("host_tree"), py::arg("rounds"),
      py::arg("requests"), py::arg("step_counts"), py::arg("steps"));
}
