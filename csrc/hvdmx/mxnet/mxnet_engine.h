// The only files that know MXNet (this header, mxnet_engine.cc for the
// engine, mxnet_arrays.cc for arrays, mxnet_api.h between the two), and
// they know only MXNet's C API.
//
// libmxnet.so is already loaded by `import mxnet` (privately, RTLD_LOCAL), so
// we find the few C functions we need with dlsym on that library: nothing is
// linked against MXNet, and no compiler or C++ ABI match with the wheel is
// ever needed.
//
// Note [Engine completion]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A collective is pushed with MXEnginePushAsyncND: inputs as const NDArrays,
// outputs as mutable ones (an in-place op lists its array once, as mutable),
// property kAsync. We hold our own shallow copies of the NDArrays (sharing
// their memory) until the collective has moved their bytes, so a temporary
// input like `hvd.allreduce(a * 2)` stays alive; we let go of them just
// before on_complete (Note [Letting go before completing]). When the engine
// runs the op, all its inputs are ready: we read the data pointers, hand a
// TensorEntry to the runtime and return at once. The runtime calls the
// entry's callback exactly once, later, from its background thread; the
// callback calls the engine's on_complete, with a dmlc::Error when the
// collective failed, which MXNet raises as MXNetError when the user reads
// the output.
#ifndef HVDMX_MXNET_ENGINE_H_
#define HVDMX_MXNET_ENGINE_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "base/common.h"
#include "negotiation/message.h"
#include "runtime/runtime.h"

namespace hvdmx {

// Resolves the C API functions from the loaded library at `path`.
Status LoadMXNetApi(const std::string& path);

// Note [oneDNN layout]
// ~~~~~~~~~~~~~~~~~~~~
// MXNet's oneDNN (MKLDNN) operators may keep an array in an internal blocked
// layout, e.g. a conv weight after an inference-mode forward. Its bytes are
// not the dense tensor, and MXNDArrayGetData converts it by pushing a reorder
// to the engine and waiting for it: inside our own engine op that waits for
// us, a deadlock. Probing an array from the Python thread at the call is no
// way out either: an array whose producing op has not run yet is allocated
// by the probe, racing the engine thread that allocates it for that op
// (garbage results, seen at -n 4). So the op checks with MXNDArrayToDLPack,
// which refuses such an array without waiting, and fails with a message that
// says to pass a plain copy; broadcast_parameters, which meets such weights,
// waits for each parameter and converts it with EnsureDefaultLayout first.

// Converts the array to the plain dense layout if oneDNN holds it in its own.
Status EnsureDefaultLayout(void* handle);

// What the Python layer checks of an array at a call, read through the C API
// in one go (each NDArray property costs a ctypes call in Python).
struct ArrayInfo {
  int dtype = -1;  // MXNet's type flag (the codes of DataType, and others)
  int stype = 0;   // storage type: 0 dense, 1 row_sparse, 2 csr
  int dev_type = 1;
  int dev_id = 0;
  int ndim = -1;  // -1: shape not known yet
  std::vector<int64_t> shape;
};
Status DescribeArray(void* handle, ArrayInfo* info);

// A new dense NDArray for a collective's output; the caller owns the handle.
// On the CPU, from 64 KiB up, its memory comes from the output pool (Note
// [Output pool] in output_pool.h); otherwise MXNet allocates it when an op
// first writes it (as mx.nd.empty's).
Status NewArray(const std::vector<int64_t>& shape, int dtype, int dev_type, int dev_id, void** out);

// A new int32 NDArray on the CPU holding `values`, written at once: the
// array is allocated here and no engine op has seen it yet. (mx.nd.array
// waits for an engine op, about 100 us.) The caller owns the handle.
Status NewInt32Array(const std::vector<int64_t>& values, void** out);

struct PushArgs {
  Request request;             // name, type, dtypes, shapes, op, ...
  std::vector<void*> inputs;   // NDArrayHandle per tensor
  std::vector<void*> outputs;  // NDArrayHandle per tensor (may equal inputs)
  int dev_type = 1;            // MXNet Context::DeviceType
  int dev_id = 0;
  int priority = 0;
};

// Pushes the collective onto MXNet's engine (see Note [Engine completion]).
// The name is checked against `runtime`'s queue when the engine runs the op.
Status PushCollective(const std::shared_ptr<Runtime>& runtime, PushArgs args);

// Runs `fn` as an MXNet engine op once `inputs` are ready, with their data
// pointers and those of `outputs` (distinct arrays, all dense and on the
// CPU), on an engine thread; an error it returns fails the op, raised as
// MXNetError when an output is read. For hvdmx's own small kernels on arrays
// (one-bit compression, onebit.h), which must stay in the engine's order
// with the collectives around them.
using ComputeFn =
    std::function<Status(const std::vector<const void*>& in, const std::vector<void*>& out)>;
Status PushCompute(const std::vector<void*>& inputs, const std::vector<void*>& outputs,
                   ComputeFn fn, const std::string& op_name);

}  // namespace hvdmx

#endif  // HVDMX_MXNET_ENGINE_H_
