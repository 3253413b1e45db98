// Thin pybind11 bindings: the module hvdmx._core. Maps Status to Python
// exceptions and releases the GIL around anything that waits; the
// process-wide state (init, shutdown, process sets) is in job.cc. Functions
// whose names start with _testing exist for the test suite only; most are
// defined in testing_bindings.cc.
#include <mpi.h>
#include <unistd.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

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
#include "mxnet/mxnet_engine.h"
#include "python/job.h"
#include "runtime/runtime.h"
#include "shm/shm_allreduce.h"
#include "testing/testing_bindings.h"

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
                      const std::vector<uintptr_t>& handles, const std::vector<int>& priorities,
                      int op, double prescale, double postscale) {
  if (names.size() != handles.size() || priorities.size() != handles.size()) {
    throw py::value_error("push_allreduce_each: one name and one priority per tensor");
  }
  std::shared_ptr<Runtime> runtime = RunningRuntime(set_id);
  std::vector<ArrayInfo> infos(handles.size());
  for (size_t i = 0; i < handles.size(); ++i) {
    ThrowIfError(DescribeArray(reinterpret_cast<void*>(handles[i]), &infos[i]));
    const ArrayProblem problem = CheckArray(infos[i]);
    if (problem != kArrayOk) return {static_cast<int>(i), problem};
  }
  for (size_t i = 0; i < handles.size(); ++i) {
    const ArrayInfo& a = infos[i];
    void* handle = reinterpret_cast<void*>(handles[i]);
    PushArgs args;
    args.request = MakeRequest(CollectiveType::kAllreduce, names[i], {a.dtype}, {a.shape}, op, 0,
                               prescale, postscale, a.dev_type, a.dev_id, runtime->rank());
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
    return py::make_tuple(outcome->status.message(), py::none(), 0,
                          static_cast<int>(outcome->status.code()));
  }
  return py::make_tuple(py::none(), outcome->response.splits, outcome->response.root,
                        static_cast<int>(Status::Code::kOk));
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
  d["direct_exchanges"] = shm->direct_exchanges();
  d["root_writes"] = shm->root_writes();
  d["writes_into_peers"] = shm->writes_into_peers();
  d["push_exchanges"] = shm->push_exchanges();
  d["direct_min_bytes"] = DirectMinBytesValue(shm->direct_min_bytes());
  d["collapsed_huge_pages"] = shm->collapsed_huge_pages();
  d["refused_huge_pages"] = shm->refused_huge_pages();
  d["streamed_calls"] = shm->streamed_calls();
  d["streaming_stores"] = StageStoresName(shm->stage_stores());
  d["bit_ands"] = shm->bit_ands();
  return d;
}

int64_t TestingFusionBufferBytes() { return RunningRuntime()->fusion_buffer_bytes(); }

// The running runtime's negotiation: slow-path rounds whose requests went
// with the bit-and and those that gathered them, and the strings (rank
// 0's responses) broadcast through shared memory (-1 without it).
py::dict TestingNegotiationInfo() {
  const std::shared_ptr<Runtime> rt = RunningRuntime();
  py::dict d;
  d["sent_with_bit_and"] = rt->controller().sent_with_bit_and();
  d["gathered"] = rt->controller().gathered();
  d["strings_broadcast"] = rt->shm() == nullptr ? -1 : rt->shm()->strings_broadcast();
  return d;
}

// The running runtime's collapsing of what it hands to MPI: whether it is
// on, and the huge pages collapsed and refused so far.
py::dict TestingMpiHugePages() {
  const HugePageCollapser& pages = RunningRuntime()->mpi_pages();
  py::dict d;
  d["enabled"] = pages.enabled();
  d["collapsed"] = pages.collapsed();
  d["refused"] = pages.refused();
  return d;
}

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
    int thread_level = 0;
    const Topology t = JobTopology(&thread_level);
    return py::make_tuple(t.rank, t.size, t.local_rank, t.local_size, t.cross_rank, t.cross_size,
                          thread_level >= MPI_THREAD_MULTIPLE);
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
  // The code negotiate() returns for an error response (Executor::Run).
  m.attr("STATUS_MISMATCH") = static_cast<int>(Status::Code::kMismatch);
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
  m.def("push_async", &PushAsync);
  m.def("push_allreduce_each", &PushAllreduceEach);
  m.def("negotiate", &Negotiate);
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
  m.def("twobit_pack", [](uintptr_t gradient, uintptr_t residual, uintptr_t packed, int64_t n,
                          float threshold) {
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

  m.def("_testing_shm_info", &TestingShmInfo);
  m.def("_testing_fusion_buffer_bytes", &TestingFusionBufferBytes);
  m.def("_testing_negotiation_info", &TestingNegotiationInfo);
  m.def("_testing_mpi_huge_pages", &TestingMpiHugePages);
  DefineTestingBindings(m);
}
