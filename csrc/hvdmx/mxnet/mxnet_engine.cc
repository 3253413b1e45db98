#include "mxnet/mxnet_engine.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <future>
#include <mutex>
#include <stdexcept>

#include "mxnet/mxnet_api.h"

namespace dmlc {
// The exception type MXNet's engine stores and rethrows; the same definition
// as in the wheel's include/dmlc/logging.h.
struct Error : public std::runtime_error {
  explicit Error(const std::string& s) : std::runtime_error(s) {}
};
}  // namespace dmlc

namespace hvdmx {

mxnet_api::Api mxnet_api::g_api;

namespace {

using mxnet_api::EngineAsyncFunc;
using mxnet_api::EngineFuncParamDeleter;
using mxnet_api::g_api;
using mxnet_api::HasDefaultLayout;
using mxnet_api::NDArrayHandle;

// Mirrors of three small types from the wheel's headers, used only through
// pointers the engine gives us or takes from us.
// mxnet/engine.h: class CallbackOnComplete { callback_, engine_, param_ }.
struct CallbackOnComplete {
  void (*callback)(void* engine, void* param, const dmlc::Error* error);
  void* engine;
  void* param;
  void operator()(const dmlc::Error* error) const { callback(engine, param, error); }
};
// mxnet/base.h: struct Context { DeviceType dev_type; int32_t dev_id; }.
struct Context {
  int32_t dev_type;
  int32_t dev_id;
};
// mxnet/engine.h: enum class FnProperty { ..., kAsync = 4, ... }: the op
// only hands work to another thread, so the engine may run it inline.
const int32_t kFnPropertyAsync = 4;
// FnProperty::kNormal: the op computes on the engine's thread (PushCompute).
const int32_t kFnPropertyNormal = 0;

bool g_naive_engine = false;

// What the engine keeps for one pushed op until it has been deleted.
struct OpParam {
  std::shared_ptr<Runtime> runtime;
  Request request;
  std::vector<NDArrayHandle> inputs;     // our shallow copies
  std::vector<NDArrayHandle> outputs;    // our shallow copies (aliases of inputs when in place)
  std::vector<NDArrayHandle> owned;      // every copy we made, freed once
  uint64_t turn = TensorEntry::kNoTurn;  // see Note [Same-name calls in flight]
  ComputeFn compute;                     // PushCompute's: run this instead of a collective
  int dev_type = 1;                      // the op's device (cpu(0) for PushCompute's)
  int dev_id = 0;
};

void DeleteOpParam(void* p) {
  OpParam* param = static_cast<OpParam*>(p);
  for (NDArrayHandle h : param->owned) g_api.free_ndarray(h);
  delete param;
}

// Note [Failing ops on the engine's worker]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// MXNet 1.9.1's threaded engine keeps every failed op's exception in one
// std::vector (ThreadedEngine::global_exception_refs_, which waitall
// rethrows and clears), appended to and searched without a lock by
// whichever thread ends an op: the op's on_complete, and the engine's
// worker when it starts an op on an array that holds an exception (the
// DeleteVariable of a failed output, an op that reads one). Its workers
// for one CPU device are one thread by default (MXNET_CPU_WORKER_NTHREADS
// is 1), so MXNet's own ops never touch the vector at once. Ours end
// elsewhere: on the runtime's thread (Runtime::Stop fails every pending
// entry when a peer shuts down or goes) or the Python thread (RunOp on a
// runtime that has just stopped). A failure ended there while the worker
// passed an earlier one on corrupted the vector: "double free or
// corruption (!prev)", "malloc(): invalid next size" or a segfault in
// mx.nd.waitall() on a rank whose peer shut down while it had
// collectives in flight (tests/test_peer_shutdown_in_flight.py). So a
// failed op of ours ends on the worker of its device: Complete pushes a
// small op there (no arrays, so it runs at once) that calls the failed
// op's on_complete with the error. Under the NaiveEngine everything runs
// on the pushing thread and the op ends at once; if the push fails, too
// (under a lock, so that our failures at least do not race each other).
// With MXNET_CPU_WORKER_NTHREADS above 1 the workers still race each other
// over the vector (MXNet's own ops too); docs/env.md says to keep it at 1.
std::mutex g_fail_mu;

struct FailParam {
  CallbackOnComplete on_complete;  // the failed op's
  std::string message;
};

void RunFail(void* /*run_context*/, void* on_complete_ptr, void* p) {
  const FailParam* fail = static_cast<const FailParam*>(p);
  CallbackOnComplete own = *static_cast<CallbackOnComplete*>(on_complete_ptr);
  dmlc::Error error(fail->message);
  fail->on_complete(&error);
  own(nullptr);
}

void DeleteFailParam(void* p) { delete static_cast<FailParam*>(p); }

// Ends an op: at once when it succeeded, else with the error on the
// engine's worker for device (dev_type, dev_id) (see the Note above).
void Complete(const CallbackOnComplete& on_complete, const Status& status, int dev_type,
              int dev_id) {
  if (status.ok()) {
    on_complete(nullptr);
    return;
  }
  if (!g_naive_engine) {
    Context ctx{dev_type, dev_id};
    auto* fail = new FailParam{on_complete, status.message()};
    if (g_api.push_async_nd(RunFail, fail, DeleteFailParam, &ctx, nullptr, 0, nullptr, 0,
                            &kFnPropertyNormal, 0, "hvdmx_failed", false) == 0) {
      return;
    }
  }
  dmlc::Error error(status.message());
  std::lock_guard<std::mutex> lock(g_fail_mu);
  on_complete(&error);
}

// Note [Letting go before completing]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Our shallow copies keep a temporary input or output alive while the op
// runs. Once the collective has moved its bytes they are not needed, and
// the entry's callback frees them before it calls on_complete, not when the
// engine deletes the op. Why it matters: on_complete wakes the reader (the
// engine runs its WaitForVar op on a worker) before the engine deletes the
// op, so the reader's thread could drop its output and call the next
// collective while our copy still held the output's block of the output
// pool. That call then needed a second block, and at a pool limit of one
// block (a 256 MiB output under HVDMX_OUTPUT_POOL_BYTES' 256 MiB) the pool
// gave a block's pages back and faulted them in again: some calls were
// much slower (docs/benchmark-notes.md, "Letting go of outputs before
// completing"). Freed first, the block is back in the pool
// when the reader drops its array.
//
// Safe because nothing in hvdmx touches the memory after the callback, and
// MXNet frees memory it allocated through the engine (DeleteVariable waits
// for our op, which holds the array's variable, to complete); a pool block
// goes back to the pool, where only a later Take, for a later op, hands it
// out. Under the NaiveEngine the copies stay until the op is deleted, as
// before: that engine runs the whole op inside the push, in the Python
// thread, so no reader runs before the op is deleted and letting go early
// gains nothing, while a last copy freed there would run DeleteVariable
// (at once, under that engine) inside the push that still runs our op.
// (Freed early anyway, tests/test_process_exit.py's NaiveEngine job passed
// under AddressSanitizer; the old order is kept as the one MXNet expects.)

// PushCompute's op: runs param->compute on the arrays' data.
void RunCompute(void* /*run_context*/, void* on_complete_ptr, void* p) {
  OpParam* param = static_cast<OpParam*>(p);
  CallbackOnComplete on_complete = *static_cast<CallbackOnComplete*>(on_complete_ptr);
  std::vector<const void*> in;
  std::vector<void*> out;
  for (size_t i = 0; i < param->inputs.size() + param->outputs.size(); ++i) {
    const bool is_input = i < param->inputs.size();
    NDArrayHandle h = is_input ? param->inputs[i] : param->outputs[i - param->inputs.size()];
    void* data = nullptr;
    if (!HasDefaultLayout(h) || g_api.get_data(h, &data) != 0) {
      Complete(on_complete,
               Status::Internal("hvdmx: could not read an array of " + param->request.name + ": " +
                                g_api.last_error()),
               param->dev_type, param->dev_id);
      return;
    }
    if (is_input) {
      in.push_back(data);
    } else {
      out.push_back(data);
    }
  }
  Complete(on_complete, param->compute(in, out), param->dev_type, param->dev_id);
}

// Called by the engine when the op's inputs are ready.
void RunOp(void* /*run_context*/, void* on_complete_ptr, void* p) {
  OpParam* param = static_cast<OpParam*>(p);
  CallbackOnComplete on_complete = *static_cast<CallbackOnComplete*>(on_complete_ptr);
  // However this returns, the op has left the engine (Runtime::AddInEngine),
  // after its entry is in the queue if it got there.
  struct LeaveEngine {
    Runtime* runtime;
    ~LeaveEngine() {
      if (runtime != nullptr) runtime->AddInEngine(-1);
    }
  } leave{param->runtime.get()};
  TensorEntry entry;
  entry.request = param->request;
  entry.turn = param->turn;
  std::string failed;  // see Request::error
  for (size_t i = 0; i < param->inputs.size() && failed.empty(); ++i) {
    const bool in_place = param->outputs[i] == param->inputs[i];
    void* in = nullptr;
    void* out = nullptr;
    int64_t in_bytes = 0;
    int64_t out_bytes = 0;
    if (!HasDefaultLayout(param->inputs[i], &in_bytes) ||
        (!in_place && !HasDefaultLayout(param->outputs[i], &out_bytes))) {
      failed = "hvdmx: tensor '" + param->request.name +
               "' is held in oneDNN's internal layout (e.g. a conv weight after an "
               "inference-mode forward); pass a plain copy instead, x.copy(), or use "
               "hvd.broadcast_parameters for parameters";
      break;
    }
    if (g_api.get_data(param->inputs[i], &in) != 0 ||
        (!in_place && g_api.get_data(param->outputs[i], &out) != 0)) {
      failed = "hvdmx: could not read the data of tensor '" + param->request.name +
               "': " + g_api.last_error();
      break;
    }
    if (in_place) out = in;
    // Large arrays on huge pages: copies into and out of them run at up to
    // twice the speed here, and a new output faults 512x fewer times.
    AdviseHugePages(in, in_bytes);
    if (!in_place) AdviseHugePages(out, out_bytes);
    entry.inputs.push_back(in);
    entry.outputs.push_back(out);
  }
  if (!failed.empty()) {
    // The other ranks learn it through negotiation rather than wait for a
    // request that never comes (see Request::error); nothing is read.
    entry.request.error = failed;
    entry.inputs.clear();
    entry.outputs.clear();
  }
  std::shared_ptr<std::promise<void>> done;
  if (g_naive_engine) done = std::make_shared<std::promise<void>>();
  // The bytes are moved when the callback runs: our copies go before the
  // engine learns it (Note [Letting go before completing]), except under
  // the NaiveEngine, see there.
  entry.callback = [on_complete, done, param](const Status& status) {
    if (!done) {
      for (NDArrayHandle h : param->owned) g_api.free_ndarray(h);
      param->owned.clear();
    }
    Complete(on_complete, status, param->dev_type, param->dev_id);
    if (done) done->set_value();
  };
  // A name is checked here, when the engine runs the op, not at the call:
  // the engine runs the ops that write one NDArray in push order, so the
  // training loop's allreduce of gradient "i" at step k+1 may be called while
  // step k's is still queued.
  Status queued = param->runtime->Enqueue(std::move(entry));
  if (!queued.ok()) {
    Complete(on_complete, queued, param->dev_type, param->dev_id);
    return;
  }
  // MXNet's NaiveEngine requires an op to complete before it returns.
  if (done) done->get_future().wait();
}

template <typename F>
Status Resolve(void* lib, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(lib, name));
  if (*out == nullptr) {
    return Status::Internal(std::string("hvdmx: libmxnet has no C function ") + name +
                            "; hvdmx needs MXNet 1.9.1 (pip install mxnet==1.9.1)");
  }
  return Status::Ok();
}

}  // namespace

Status LoadMXNetApi(const std::string& path) {
  if (g_api.push_async_nd != nullptr) return Status::Ok();
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    return Status::Internal("hvdmx: could not open " + path + ": " + dlerror());
  }
  mxnet_api::Api api;
  Status s = Resolve(lib, "MXEnginePushAsyncND", &api.push_async_nd);
  if (s.ok()) s = Resolve(lib, "MXNDArrayGetData", &api.get_data);
  if (s.ok()) s = Resolve(lib, "MXNDArrayToDLPack", &api.to_dlpack);
  if (s.ok()) s = Resolve(lib, "MXNDArrayCallDLPackDeleter", &api.dlpack_deleter);
  if (s.ok()) s = Resolve(lib, "MXShallowCopyNDArray", &api.shallow_copy);
  if (s.ok()) s = Resolve(lib, "MXNDArrayFree", &api.free_ndarray);
  if (s.ok()) s = Resolve(lib, "MXGetLastError", &api.last_error);
  if (s.ok()) s = Resolve(lib, "MXNDArrayGetDType", &api.get_dtype);
  if (s.ok()) s = Resolve(lib, "MXNDArrayGetStorageType", &api.get_storage_type);
  if (s.ok()) s = Resolve(lib, "MXNDArrayGetContext", &api.get_context);
  if (s.ok()) s = Resolve(lib, "MXNDArrayGetShapeEx", &api.get_shape);
  if (s.ok()) s = Resolve(lib, "MXNDArrayCreateEx", &api.create);
  if (s.ok()) s = Resolve(lib, "MXNDArrayFromDLPackEx", &api.from_dlpack);
  if (!s.ok()) return s;
  g_api = api;
  const char* engine = std::getenv("MXNET_ENGINE_TYPE");
  g_naive_engine = engine != nullptr && std::strcmp(engine, "NaiveEngine") == 0;
  return Status::Ok();
}

namespace {

// Pushes `param`'s op (inputs read, outputs written) onto the engine, which
// takes ownership of it whatever the outcome.
Status Push(std::unique_ptr<OpParam> param, std::vector<NDArrayHandle> const_handles,
            std::vector<NDArrayHandle> mutable_handles, int dev_type, int dev_id, int priority,
            const std::string& op_name) {
  Context ctx{dev_type, dev_id};
  const bool compute = static_cast<bool>(param->compute);
  OpParam* raw = param.release();
  int rc = g_api.push_async_nd(compute ? RunCompute : RunOp, raw, DeleteOpParam, &ctx,
                               const_handles.data(), static_cast<int>(const_handles.size()),
                               mutable_handles.data(), static_cast<int>(mutable_handles.size()),
                               compute ? &kFnPropertyNormal : &kFnPropertyAsync, priority,
                               op_name.c_str(), false);
  if (rc != 0) {
    // The engine did not take the op; it owns `raw` and its deleter.
    return Status::Internal(std::string("hvdmx: MXEnginePushAsyncND failed: ") +
                            g_api.last_error());
  }
  return Status::Ok();
}

}  // namespace

Status PushCollective(const std::shared_ptr<Runtime>& runtime, PushArgs args) {
  HVDMX_CHECK(g_api.push_async_nd != nullptr, "MXNet API not loaded");
  HVDMX_CHECK(args.inputs.size() == args.outputs.size(), "inputs and outputs differ in number");
  auto param = std::make_unique<OpParam>();
  param->runtime = runtime;
  param->request = std::move(args.request);
  param->dev_type = args.dev_type;
  param->dev_id = args.dev_id;

  std::vector<NDArrayHandle> const_handles;
  std::vector<NDArrayHandle> mutable_handles;
  auto fail = [&](const std::string& what) {
    for (NDArrayHandle h : param->owned) g_api.free_ndarray(h);
    return Status::Internal("hvdmx: " + what + ": " + g_api.last_error());
  };
  for (size_t i = 0; i < args.inputs.size(); ++i) {
    NDArrayHandle in_copy = nullptr;
    if (g_api.shallow_copy(args.inputs[i], &in_copy) != 0) return fail("MXShallowCopyNDArray");
    param->owned.push_back(in_copy);
    NDArrayHandle out_copy = in_copy;
    if (args.outputs[i] != args.inputs[i]) {
      if (g_api.shallow_copy(args.outputs[i], &out_copy) != 0) return fail("MXShallowCopyNDArray");
      param->owned.push_back(out_copy);
      const_handles.push_back(in_copy);
    }
    mutable_handles.push_back(out_copy);
    param->inputs.push_back(in_copy);
    param->outputs.push_back(out_copy);
  }
  const std::string op_name = "hvdmx_" + CollectiveTypeName(param->request.type);
  // Both before the push: the engine may run the op at once.
  const std::string name = param->request.name;
  param->turn = runtime->ReserveTurn(name);
  const uint64_t turn = param->turn;
  runtime->AddInEngine(1);
  Status pushed = Push(std::move(param), const_handles, mutable_handles, args.dev_type, args.dev_id,
                       args.priority, op_name);
  if (!pushed.ok()) {
    runtime->AddInEngine(-1);
    runtime->CancelTurn(name, turn);
  }
  return pushed;
}

Status PushCompute(const std::vector<void*>& inputs, const std::vector<void*>& outputs,
                   ComputeFn fn, const std::string& op_name) {
  HVDMX_CHECK(g_api.push_async_nd != nullptr, "MXNet API not loaded");
  auto param = std::make_unique<OpParam>();
  param->compute = std::move(fn);
  param->request.name = op_name;
  std::vector<NDArrayHandle> const_handles;
  std::vector<NDArrayHandle> mutable_handles;
  for (size_t i = 0; i < inputs.size() + outputs.size(); ++i) {
    const bool is_input = i < inputs.size();
    NDArrayHandle copy = nullptr;
    if (g_api.shallow_copy(is_input ? inputs[i] : outputs[i - inputs.size()], &copy) != 0) {
      for (NDArrayHandle h : param->owned) g_api.free_ndarray(h);
      return Status::Internal(std::string("hvdmx: MXShallowCopyNDArray: ") + g_api.last_error());
    }
    param->owned.push_back(copy);
    (is_input ? param->inputs : param->outputs).push_back(copy);
    (is_input ? const_handles : mutable_handles).push_back(copy);
  }
  return Push(std::move(param), const_handles, mutable_handles, 1, 0, 0, op_name);
}

}  // namespace hvdmx
