// The arrays side of mxnet_engine.h: describing the arrays a call is given,
// making its outputs (from the output pool where it serves them) and
// bringing oneDNN-layout arrays back to the plain layout.
#include <dlpack/dlpack.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>

#include "mxnet/mxnet_api.h"
#include "mxnet/mxnet_engine.h"
#include "platform/output_pool.h"

namespace hvdmx {

using mxnet_api::g_api;
using mxnet_api::HasDefaultLayout;
using mxnet_api::NDArrayHandle;

bool mxnet_api::HasDefaultLayout(NDArrayHandle handle, int64_t* bytes) {
  void* dl = nullptr;
  if (g_api.to_dlpack(handle, &dl) != 0) return false;
  if (bytes != nullptr) {
    const DLTensor& t = static_cast<const DLManagedTensor*>(dl)->dl_tensor;
    int64_t n = t.dtype.bits / 8 * t.dtype.lanes;
    for (int32_t i = 0; i < t.ndim; ++i) n *= t.shape[i];
    *bytes = n;
  }
  g_api.dlpack_deleter(dl);
  return true;
}

Status EnsureDefaultLayout(void* handle) {
  HVDMX_CHECK(g_api.get_data != nullptr, "MXNet API not loaded");
  if (HasDefaultLayout(handle)) return Status::Ok();
  void* data = nullptr;
  if (g_api.get_data(handle, &data) != 0) {
    return Status::Internal(std::string("hvdmx: could not read an NDArray: ") + g_api.last_error());
  }
  return Status::Ok();
}

Status DescribeArray(void* handle, ArrayInfo* info) {
  HVDMX_CHECK(g_api.get_shape != nullptr, "MXNet API not loaded");
  const int* dims = nullptr;
  int ndim = -1;
  if (g_api.get_dtype(handle, &info->dtype) != 0 ||
      g_api.get_storage_type(handle, &info->stype) != 0 ||
      g_api.get_context(handle, &info->dev_type, &info->dev_id) != 0 ||
      g_api.get_shape(handle, &ndim, &dims) != 0) {
    return Status::Internal(std::string("hvdmx: could not describe an NDArray: ") +
                            g_api.last_error());
  }
  info->ndim = ndim;
  info->shape.assign(dims, dims + std::max(ndim, 0));
  return Status::Ok();
}

namespace {

// DLPack's type for MXNet's type flags 0..7 (mshadow/base.h: float32,
// float64, float16, uint8, int32, int8, int64, bool); false for the others.
bool DLPackType(int dtype, DLDataType* out) {
  static const DLDataType kTypes[] = {{kDLFloat, 32, 1}, {kDLFloat, 64, 1}, {kDLFloat, 16, 1},
                                      {kDLUInt, 8, 1},   {kDLInt, 32, 1},   {kDLInt, 8, 1},
                                      {kDLInt, 64, 1},   {kDLUInt, 1, 1}};
  if (dtype < 0 || dtype >= static_cast<int>(sizeof(kTypes) / sizeof(kTypes[0]))) return false;
  *out = kTypes[dtype];
  return true;
}

// What a pooled output's DLManagedTensor points to until MXNet deletes it.
struct PooledTensor {
  DLManagedTensor managed;
  std::vector<int64_t> shape;
  int64_t bytes;
};

void GiveBack(DLManagedTensor* managed) {
  PooledTensor* t = static_cast<PooledTensor*>(managed->manager_ctx);
  OutputPool::Get().Give(t->managed.dl_tensor.data, t->bytes);
  delete t;
}

// An NDArray over a block of the output pool (Note [Output pool]), or
// nullptr in *out when the array is not one the pool serves.
Status NewPooledArray(const std::vector<int64_t>& shape, int dtype, int dev_type, int dev_id,
                      void** out) {
  *out = nullptr;
  DLDataType type;
  if (dev_type != kDLCPU || !DLPackType(dtype, &type)) return Status::Ok();
  int64_t bytes = (type.bits + 7) / 8;
  for (int64_t d : shape) bytes *= d;
  if (bytes < OutputPool::kMinBytes) return Status::Ok();
  void* block = OutputPool::Get().Take(bytes);
  if (block == nullptr) return Status::Ok();  // MXNet allocates it instead
  auto* t = new PooledTensor{};
  t->shape = shape;
  t->bytes = bytes;
  DLTensor& dl = t->managed.dl_tensor;
  dl.data = block;
  dl.ctx = {kDLCPU, dev_id};
  dl.ndim = static_cast<int>(shape.size());
  dl.dtype = type;
  dl.shape = t->shape.data();
  dl.strides = nullptr;
  dl.byte_offset = 0;
  t->managed.manager_ctx = t;
  t->managed.deleter = GiveBack;
  if (g_api.from_dlpack(&t->managed, /*transient_handle=*/false, out) != 0) {
    GiveBack(&t->managed);
    return Status::Internal(std::string("hvdmx: MXNDArrayFromDLPackEx failed: ") +
                            g_api.last_error());
  }
  return Status::Ok();
}

}  // namespace

Status NewArray(const std::vector<int64_t>& shape, int dtype, int dev_type, int dev_id,
                void** out) {
  HVDMX_CHECK(g_api.create != nullptr, "MXNet API not loaded");
  std::vector<uint32_t> dims;
  for (int64_t d : shape) {
    // The wheel is built without 64-bit tensor sizes: each dimension is a uint32.
    if (d < 0 || d > static_cast<int64_t>(UINT32_MAX)) {
      return Status::InvalidArgument("hvdmx: an output dimension of " + std::to_string(d) +
                                     " does not fit MXNet's 32-bit shapes");
    }
    dims.push_back(static_cast<uint32_t>(d));
  }
  Status pooled = NewPooledArray(shape, dtype, dev_type, dev_id, out);
  if (!pooled.ok() || *out != nullptr) return pooled;
  if (g_api.create(dims.data(), static_cast<uint32_t>(dims.size()), dev_type, dev_id,
                   /*delay_alloc=*/1, dtype, out) != 0) {
    return Status::Internal(std::string("hvdmx: MXNDArrayCreateEx failed: ") + g_api.last_error());
  }
  return Status::Ok();
}

Status NewInt32Array(const std::vector<int64_t>& values, void** out) {
  HVDMX_CHECK(g_api.create != nullptr, "MXNet API not loaded");
  const uint32_t dims[1] = {static_cast<uint32_t>(values.size())};
  for (int64_t v : values) {
    if (v < INT32_MIN || v > INT32_MAX) {
      return Status::InvalidArgument("hvdmx: " + std::to_string(v) +
                                     " does not fit an int32 array");
    }
  }
  constexpr int kCpu = 1;
  if (g_api.create(dims, 1, kCpu, 0, /*delay_alloc=*/0, static_cast<int>(DataType::kInt32), out) !=
      0) {
    return Status::Internal(std::string("hvdmx: MXNDArrayCreateEx failed: ") + g_api.last_error());
  }
  void* data = nullptr;
  if (!values.empty() && (g_api.get_data(*out, &data) != 0 || data == nullptr)) {
    g_api.free_ndarray(*out);
    *out = nullptr;
    return Status::Internal(std::string("hvdmx: MXNDArrayGetData failed: ") + g_api.last_error());
  }
  for (size_t i = 0; i < values.size(); ++i) {
    static_cast<int32_t*>(data)[i] = static_cast<int32_t>(values[i]);
  }
  return Status::Ok();
}

}  // namespace hvdmx
