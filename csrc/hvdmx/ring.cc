#include "ring.h"

#include <algorithm>
#include <cstring>

#include "reduce_kernels.h"

namespace hvdmx {

void RingScratch::Reserve(int64_t segment_bytes) {
  if (half_bytes_ >= segment_bytes) return;
  half_bytes_ = segment_bytes;
  buffer_.assign(2 * segment_bytes, 0);  // assign touches every page now
}

int64_t RingChunkStart(int64_t count, int n, int c) {
  const int64_t base = count / n;
  const int64_t rem = count % n;
  return c * base + std::min<int64_t>(c, rem);
}

namespace {

int Mod(int a, int n) { return ((a % n) + n) % n; }

// One step: send chunk `send_c` to the right, receive chunk `recv_c` from the
// left, segment by segment, two segments in flight each way. Chunk c is
// elements [starts[c], starts[c+1]). With `reduce`, received segments land
// in scratch and are reduced into place; without, they are received straight
// into place.
void RingStep(Comm& comm, char* base, const int64_t* starts, DataType dtype, ReduceOp op,
              int64_t seg_elems, int send_c, int recv_c, bool reduce, RingScratch* scratch) {
  const int n = comm.size();
  const int right = (comm.rank() + 1) % n;
  const int left = Mod(comm.rank() - 1, n);
  const int64_t elem = static_cast<int64_t>(DataTypeSize(dtype));

  const int64_t send_begin = starts[send_c];
  const int64_t send_len = starts[send_c + 1] - send_begin;
  const int64_t recv_begin = starts[recv_c];
  const int64_t recv_len = starts[recv_c + 1] - recv_begin;
  const int64_t send_segs = (send_len + seg_elems - 1) / seg_elems;
  const int64_t recv_segs = (recv_len + seg_elems - 1) / seg_elems;

  auto seg_len = [&](int64_t len, int64_t k) { return std::min(seg_elems, len - k * seg_elems); };
  auto recv_target = [&](int64_t k) -> char* {
    return reduce ? scratch->half(static_cast<int>(k % 2))
                  : base + (recv_begin + k * seg_elems) * elem;
  };
  auto post_recv = [&](int64_t k) {
    return comm.IRecv(recv_target(k), seg_len(recv_len, k) * elem, left);
  };
  auto post_send = [&](int64_t k) {
    return comm.ISend(base + (send_begin + k * seg_elems) * elem, seg_len(send_len, k) * elem,
                      right);
  };

  Comm::Request recv_req[2] = {0, 0};
  Comm::Request send_req[2] = {0, 0};
  for (int64_t k = 0; k < std::min<int64_t>(2, recv_segs); ++k) recv_req[k] = post_recv(k);
  for (int64_t k = 0; k < std::min<int64_t>(2, send_segs); ++k) send_req[k] = post_send(k);

  for (int64_t k = 0; k < std::max(send_segs, recv_segs); ++k) {
    if (k < recv_segs) {
      comm.Wait(recv_req[k % 2]);
      if (reduce) {
        ReduceInto(base + (recv_begin + k * seg_elems) * elem, scratch->half(k % 2),
                   seg_len(recv_len, k), dtype, op);
      }
      if (k + 2 < recv_segs) recv_req[k % 2] = post_recv(k + 2);
    }
    if (k < send_segs) {
      comm.Wait(send_req[k % 2]);
      if (k + 2 < send_segs) send_req[k % 2] = post_send(k + 2);
    }
  }
}

int64_t SegmentElems(int64_t segment_bytes, DataType dtype) {
  const int64_t elem = static_cast<int64_t>(DataTypeSize(dtype));
  return std::max<int64_t>(1, std::min(segment_bytes, Comm::kMaxMessageBytes) / elem);
}

// Reduce-scatter steps: afterwards rank r holds the finished chunk r + shift.
void ReduceScatterSteps(Comm& comm, char* base, const int64_t* starts, DataType dtype,
                        ReduceOp op, int64_t seg_elems, int shift, RingScratch* scratch) {
  const int n = comm.size();
  const int r = comm.rank();
  scratch->Reserve(seg_elems * static_cast<int64_t>(DataTypeSize(dtype)));
  for (int s = 0; s < n - 1; ++s) {
    RingStep(comm, base, starts, dtype, op, seg_elems, Mod(r + shift - 1 - s, n),
             Mod(r + shift - 2 - s, n), /*reduce=*/true, scratch);
  }
}

// Allgather steps, starting from rank r holding chunk r + shift.
void AllgatherSteps(Comm& comm, char* base, const int64_t* starts, DataType dtype,
                    int64_t seg_elems, int shift, RingScratch* scratch) {
  const int n = comm.size();
  const int r = comm.rank();
  for (int s = 0; s < n - 1; ++s) {
    RingStep(comm, base, starts, dtype, ReduceOp::kSum, seg_elems, Mod(r + shift - s, n),
             Mod(r + shift - 1 - s, n), /*reduce=*/false, scratch);
  }
}

}  // namespace

void RingAllreduce(Comm& comm, void* buf, int64_t count, DataType dtype, ReduceOp op,
                   int64_t segment_bytes, RingScratch* scratch) {
  const int n = comm.size();
  if (n == 1 || count == 0) return;
  std::vector<int64_t>& starts = scratch->starts;
  starts.resize(n + 1);
  for (int c = 0; c <= n; ++c) starts[c] = RingChunkStart(count, n, c);
  const int64_t seg_elems = SegmentElems(segment_bytes, dtype);
  char* base = static_cast<char*>(buf);
  ReduceScatterSteps(comm, base, starts.data(), dtype, op, seg_elems, /*shift=*/1, scratch);
  AllgatherSteps(comm, base, starts.data(), dtype, seg_elems, /*shift=*/1, scratch);
}

void RingAllreduceWidened(Comm& comm, float* wide, void* buf, int64_t count, DataType dtype,
                          ReduceOp op, double postscale, int64_t segment_bytes,
                          RingScratch* scratch) {
  const int n = comm.size();
  if (count == 0) return;
  if (n == 1) {
    NarrowScaled(buf, wide, count, dtype, postscale);
    return;
  }
  std::vector<int64_t>& starts = scratch->starts;
  starts.resize(n + 1);
  for (int c = 0; c <= n; ++c) starts[c] = RingChunkStart(count, n, c);
  ReduceScatterSteps(comm, reinterpret_cast<char*>(wide), starts.data(), DataType::kFloat32, op,
                     SegmentElems(segment_bytes, DataType::kFloat32), /*shift=*/1, scratch);
  const int mine = (comm.rank() + 1) % n;  // the chunk this rank finished
  const int64_t elem = static_cast<int64_t>(DataTypeSize(dtype));
  NarrowScaled(static_cast<char*>(buf) + starts[mine] * elem, wide + starts[mine],
               starts[mine + 1] - starts[mine], dtype, postscale);
  AllgatherSteps(comm, static_cast<char*>(buf), starts.data(), dtype,
                 SegmentElems(segment_bytes, dtype), /*shift=*/1, scratch);
}

void RingCrossAllreduce(Comm& comm, void* buf, float* wide, int64_t count, DataType dtype,
                        ReduceOp op, double postscale, bool wide_partials,
                        int64_t segment_bytes, RingScratch* scratch) {
  if (wide == nullptr) {
    RingAllreduce(comm, buf, count, dtype, op, segment_bytes, scratch);
  } else if (wide_partials) {
    RingAllreduceWidened(comm, wide, buf, count, dtype, op, postscale, segment_bytes, scratch);
  } else {
    NarrowScaled(buf, wide, count, dtype, 1.0);
    RingAllreduce(comm, buf, count, dtype, op, segment_bytes, scratch);
    ScaleBuffer(buf, count, dtype, postscale);
  }
}

void RingReduceScatter(Comm& comm, void* buf, const std::vector<int64_t>& starts,
                       DataType dtype, ReduceOp op, int64_t segment_bytes,
                       RingScratch* scratch) {
  if (comm.size() == 1 || starts.back() == 0) return;
  ReduceScatterSteps(comm, static_cast<char*>(buf), starts.data(), dtype, op,
                     SegmentElems(segment_bytes, dtype), /*shift=*/0, scratch);
}

void RingAllgather(Comm& comm, void* buf, const std::vector<int64_t>& starts, DataType dtype,
                   RingScratch* scratch) {
  if (comm.size() == 1 || starts.back() == 0) return;
  // Nothing is reduced, so nothing gains from small segments: each block
  // goes in pieces of the largest message the transport takes.
  AllgatherSteps(comm, static_cast<char*>(buf), starts.data(), dtype,
                 SegmentElems(Comm::kMaxMessageBytes, dtype), /*shift=*/0, scratch);
}

}  // namespace hvdmx
