#include "base/common.h"

#include <sys/mman.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace hvdmx {

size_t DataTypeSize(DataType dtype) {
  switch (dtype) {
    case DataType::kUInt8:
    case DataType::kInt8: return 1;
    case DataType::kFloat16:
    case DataType::kBFloat16: return 2;
    case DataType::kFloat32:
    case DataType::kInt32: return 4;
    case DataType::kFloat64:
    case DataType::kInt64: return 8;
  }
  return 0;
}

bool IsSupportedDataType(int32_t code) {
  switch (code) {
    case 0:
    case 1:
    case 2:
    case 3:
    case 4:
    case 5:
    case 6:
    case 12: return true;
    default: return false;
  }
}

std::string DataTypeName(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32: return "float32";
    case DataType::kFloat64: return "float64";
    case DataType::kFloat16: return "float16";
    case DataType::kUInt8: return "uint8";
    case DataType::kInt32: return "int32";
    case DataType::kInt8: return "int8";
    case DataType::kInt64: return "int64";
    case DataType::kBFloat16: return "bfloat16";
  }
  return "dtype(" + std::to_string(static_cast<int>(dtype)) + ")";
}

std::string ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kAverage: return "Average";
    case ReduceOp::kSum: return "Sum";
    case ReduceOp::kAdasum: return "Adasum";
    case ReduceOp::kMin: return "Min";
    case ReduceOp::kMax: return "Max";
    case ReduceOp::kProduct: return "Product";
  }
  return "op(" + std::to_string(static_cast<int>(op)) + ")";
}

std::string CollectiveTypeName(CollectiveType type) {
  switch (type) {
    case CollectiveType::kAllreduce: return "allreduce";
    case CollectiveType::kBroadcast: return "broadcast";
    case CollectiveType::kAllgather: return "allgather";
    case CollectiveType::kAlltoall: return "alltoall";
    case CollectiveType::kReducescatter: return "reducescatter";
    case CollectiveType::kBarrier: return "barrier";
    case CollectiveType::kJoin: return "join";
  }
  return "collective(" + std::to_string(static_cast<int>(type)) + ")";
}

void AdviseHugePages(void* data, int64_t bytes) {
  constexpr int64_t kHuge = int64_t{2} << 20;
  if (data == nullptr || bytes < 2 * kHuge) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~uintptr_t(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~uintptr_t(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) out << ", ";
    out << shape[i];
  }
  if (shape.size() == 1) out << ",";
  out << ")";
  return out.str();
}

namespace internal {
void CheckFailed(const char* file, int line, const char* cond, const std::string& msg) {
  std::fprintf(stderr,
               "hvdmx internal error at %s:%d: check '%s' failed: %s\n"
               "This is a bug in hvdmx; please report it with this message.\n",
               file, line, cond, msg.c_str());
  std::fflush(stderr);
  std::abort();
}
}  // namespace internal

}  // namespace hvdmx
