#include "algorithms/exchange_allreduce.h"

#include <cstring>

#include "algorithms/bruck.h"
#include "algorithms/reduce_kernels.h"

namespace hvdmx {

void ExchangeAllreduce(DataComm& comm, void* buf, int64_t count, DataType dtype, ReduceOp op,
                       std::vector<char>* scratch) {
  const int n = comm.size();
  const int me = comm.rank();
  const int64_t bytes = count * static_cast<int64_t>(DataTypeSize(dtype));
  // Rank j's buffer at slot j (ours is `buf`), then the accumulator.
  scratch->resize(static_cast<size_t>(bytes) * (n + 1));
  char* slots = scratch->data();
  char* acc = slots + static_cast<size_t>(bytes) * n;
  auto operand = [&](int j) -> const char* {
    return j == me ? static_cast<const char*>(buf) : slots + static_cast<size_t>(bytes) * j;
  };
  if (comm.LinksEveryPair()) {
    std::vector<DataComm::Request> requests;
    requests.reserve(2 * static_cast<size_t>(n));
    for (int j = 0; j < n; ++j) {
      if (j != me) requests.push_back(comm.IRecv(slots + static_cast<size_t>(bytes) * j, bytes, j));
    }
    for (int k = 1; k < n; ++k) requests.push_back(comm.ISend(buf, bytes, (me + k) % n));
    for (DataComm::Request r : requests) comm.Wait(r);
  } else {
    if (bytes > 0) std::memcpy(slots + static_cast<size_t>(bytes) * me, buf, bytes);
    BruckAllgather(comm, slots, bytes);
  }
  if (bytes == 0) return;  // an empty tensor's pointers may be null, which memcpy must not see
  std::memcpy(acc, operand(0), bytes);
  for (int j = 1; j < n; ++j) ReduceInto(acc, operand(j), count, dtype, op);
  std::memcpy(buf, acc, bytes);
}

}  // namespace hvdmx
