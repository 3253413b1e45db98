// The allreduce for small tensors over a comm without one of its own
// (TcpComm): every rank sends its whole buffer to every other at once, then
// folds the n buffers in rank order. One message's latency, where the ring
// takes 2(n-1) steps one after another; it sends (n-1) times the buffer
// where the ring sends 2(n-1)/n times, so it is for small buffers only
// (ExchangeAllreduceFits). Over a comm that does not link every pair (Note
// [The data comm's links] in comm/p2p_comm.h) the buffers travel by Bruck's
// allgather instead (algorithms/bruck.h): the same bytes received, in
// ceil(log2 n) latencies. Every rank folds the same operands in the same
// order either way, so the results are bitwise identical, and the same as
// the direct exchange's.
#ifndef HVDMX_EXCHANGE_ALLREDUCE_H_
#define HVDMX_EXCHANGE_ALLREDUCE_H_

#include <cstdint>
#include <vector>

#include "base/common.h"
#include "comm/comm.h"

namespace hvdmx {

// Whether `bytes` per rank is small enough for ExchangeAllreduce on `size`
// ranks: at most kExchangeMaxBytes sent by each rank.
constexpr int64_t kExchangeMaxBytes = 256 * 1024;
inline bool ExchangeAllreduceFits(int64_t bytes, int size) {
  return bytes * (size - 1) <= kExchangeMaxBytes;
}

// In place; Average is reduced as Sum (the caller scales). `scratch` is
// reused between calls.
void ExchangeAllreduce(DataComm& comm, void* buf, int64_t count, DataType dtype, ReduceOp op,
                       std::vector<char>* scratch);

}  // namespace hvdmx

#endif  // HVDMX_EXCHANGE_ALLREDUCE_H_
