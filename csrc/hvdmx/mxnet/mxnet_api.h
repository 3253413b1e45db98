// What mxnet_engine.cc and mxnet_arrays.cc share: MXNet's C API functions,
// found with dlsym by LoadMXNetApi (see mxnet_engine.h), and a layout probe.
// Internal to those two files.
#ifndef HVDMX_MXNET_API_H_
#define HVDMX_MXNET_API_H_

#include <dlpack/dlpack.h>

#include <cstdint>

namespace hvdmx {
namespace mxnet_api {

using NDArrayHandle = void*;
using EngineAsyncFunc = void (*)(void*, void*, void*);
using EngineFuncParamDeleter = void (*)(void*);

struct Api {
  int (*push_async_nd)(EngineAsyncFunc, void*, EngineFuncParamDeleter, const void*, NDArrayHandle*,
                       int, NDArrayHandle*, int, const void*, int, const char*, bool) = nullptr;
  int (*get_data)(NDArrayHandle, void**) = nullptr;
  int (*to_dlpack)(NDArrayHandle, void**) = nullptr;
  int (*dlpack_deleter)(void*) = nullptr;
  int (*shallow_copy)(NDArrayHandle, NDArrayHandle*) = nullptr;
  int (*free_ndarray)(NDArrayHandle) = nullptr;
  const char* (*last_error)() = nullptr;
  int (*get_dtype)(NDArrayHandle, int*) = nullptr;
  int (*get_storage_type)(NDArrayHandle, int*) = nullptr;
  int (*get_context)(NDArrayHandle, int*, int*) = nullptr;
  int (*get_shape)(NDArrayHandle, int*, const int**) = nullptr;
  int (*create)(const uint32_t*, uint32_t, int, int, int, int, NDArrayHandle*) = nullptr;
  int (*from_dlpack)(DLManagedTensor*, bool, NDArrayHandle*) = nullptr;
};

// Set once by LoadMXNetApi (mxnet_engine.cc); every member null until then.
extern Api g_api;

// True when the array's data can be read as a plain dense buffer; *bytes is
// then its size. An array in oneDNN's internal layout cannot: MXNDArrayToDLPack
// refuses it without waiting, whereas MXNDArrayGetData would reorder it
// through the engine and wait, which deadlocks inside an engine op (see Note
// [oneDNN layout] in mxnet_engine.h). In mxnet_arrays.cc.
bool HasDefaultLayout(NDArrayHandle handle, int64_t* bytes = nullptr);

}  // namespace mxnet_api
}  // namespace hvdmx

#endif  // HVDMX_MXNET_API_H_
