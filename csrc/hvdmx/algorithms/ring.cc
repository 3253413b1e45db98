#include "algorithms/ring.h"

#include <algorithm>
#include <cstring>

#include "algorithms/reduce_kernels.h"

namespace hvdmx {

void RingScratch::Reserve(int64_t segment_bytes) {
  if (half_bytes_ >= segment_bytes) return;
  // Whole cache lines, so that both halves are aligned for any element.
  half_bytes_ = (segment_bytes + 63) / 64 * 64;
  buffer_.assign(2 * half_bytes_, 0);  // assign touches every page now
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
// elements [starts[c], starts[c+1]) of `elem` bytes. With `reduce`, received
// segments land in scratch and fold(segment, first element, elements)
// combines each with this rank's elements (and may change the scratch);
// without, they are received straight into place.
template <typename Fold>
void RingStep(DataComm& comm, char* base, const int64_t* starts, int64_t elem, int64_t seg_elems,
              int send_c, int recv_c, bool reduce, RingScratch* scratch, Fold&& fold) {
  const int n = comm.size();
  const int right = (comm.rank() + 1) % n;
  const int left = Mod(comm.rank() - 1, n);

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

  DataComm::Request recv_req[2] = {0, 0};
  DataComm::Request send_req[2] = {0, 0};
  for (int64_t k = 0; k < std::min<int64_t>(2, recv_segs); ++k) recv_req[k] = post_recv(k);
  for (int64_t k = 0; k < std::min<int64_t>(2, send_segs); ++k) send_req[k] = post_send(k);

  for (int64_t k = 0; k < std::max(send_segs, recv_segs); ++k) {
    if (k < recv_segs) {
      comm.Wait(recv_req[k % 2]);
      if (reduce) fold(scratch->half(k % 2), recv_begin + k * seg_elems, seg_len(recv_len, k));
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
  return std::max<int64_t>(1, std::min(segment_bytes, DataComm::kMaxMessageBytes) / elem);
}

// Reduce-scatter steps: afterwards rank r holds the finished chunk r + shift.
// fold_for_step(s) is step s's fold (see RingStep).
template <typename FoldForStep>
void ReduceScatterSteps(DataComm& comm, char* base, const int64_t* starts, int64_t elem,
                        int64_t seg_elems, int shift, RingScratch* scratch,
                        FoldForStep&& fold_for_step) {
  const int n = comm.size();
  const int r = comm.rank();
  scratch->Reserve(seg_elems * elem);
  for (int s = 0; s < n - 1; ++s) {
    RingStep(comm, base, starts, elem, seg_elems, Mod(r + shift - 1 - s, n),
             Mod(r + shift - 2 - s, n), /*reduce=*/true, scratch, fold_for_step(s));
  }
}

// The reduce-scatter in the dtype: own = own OP received.
void ReduceScatterSteps(DataComm& comm, char* base, const int64_t* starts, DataType dtype,
                        ReduceOp op, int64_t seg_elems, int shift, RingScratch* scratch) {
  const int64_t elem = static_cast<int64_t>(DataTypeSize(dtype));
  ReduceScatterSteps(comm, base, starts, elem, seg_elems, shift, scratch, [&](int) {
    return [&](const char* received, int64_t first, int64_t len) {
      ReduceInto(base + first * elem, received, len, dtype, op);
    };
  });
}

// Allgather steps, starting from rank r holding chunk r + shift.
void AllgatherSteps(DataComm& comm, char* base, const int64_t* starts, DataType dtype,
                    int64_t seg_elems, int shift, RingScratch* scratch) {
  const int n = comm.size();
  const int r = comm.rank();
  const int64_t elem = static_cast<int64_t>(DataTypeSize(dtype));
  for (int s = 0; s < n - 1; ++s) {
    RingStep(comm, base, starts, elem, seg_elems, Mod(r + shift - s, n), Mod(r + shift - 1 - s, n),
             /*reduce=*/false, scratch, [](const char*, int64_t, int64_t) {});
  }
}

}  // namespace

void RingAllreduce(DataComm& comm, void* buf, int64_t count, DataType dtype, ReduceOp op,
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

void RingAllreduceWidened(DataComm& comm, void* buf, float* wide, bool operands_in_wide,
                          int64_t count, DataType dtype, ReduceOp op, Scale scale,
                          int64_t segment_bytes, RingScratch* scratch) {
  const int n = comm.size();
  if (count == 0) return;
  char* half = static_cast<char*>(buf);
  const int64_t elem = static_cast<int64_t>(DataTypeSize(dtype));
  if (n == 1) {
    if (!operands_in_wide) WidenScaled(wide, half, count, dtype, scale.pre);
    NarrowScaled(half, wide, count, dtype, scale.post);
    return;
  }
  std::vector<int64_t>& starts = scratch->starts;
  starts.resize(n + 1);
  for (int c = 0; c <= n; ++c) starts[c] = RingChunkStart(count, n, c);
  // Step 0 sends this rank's own chunk r: widened first. Every other chunk's
  // float32 partials are written by the step that receives it, from the
  // received partials and this rank's operands, which are read where they
  // are; the last step rounds its chunk, the rank's finished one, into buf.
  const int r = comm.rank();
  if (!operands_in_wide) {
    WidenScaled(wide + starts[r], half + starts[r] * elem, starts[r + 1] - starts[r], dtype,
                scale.pre);
  }
  ReduceScatterSteps(
      comm, reinterpret_cast<char*>(wide), starts.data(), int64_t{4},
      SegmentElems(segment_bytes, DataType::kFloat32), /*shift=*/1, scratch, [&](int s) {
        const bool last = s == n - 2;
        return [&, last](char* received, int64_t first, int64_t len) {
          auto* partial = reinterpret_cast<float*>(received);  // partial OP= own
          if (operands_in_wide) {
            ReduceInto(partial, wide + first, len, DataType::kFloat32, op);
          } else {
            ReduceWidenedInto(partial, half + first * elem, len, dtype, op, scale.pre);
          }
          if (last) {
            NarrowScaled(half + first * elem, partial, len, dtype, scale.post);
          } else {
            std::memcpy(wide + first, partial, len * 4);
          }
        };
      });
  AllgatherSteps(comm, half, starts.data(), dtype, SegmentElems(segment_bytes, dtype),
                 /*shift=*/1, scratch);
}

void RingCrossAllreduce(DataComm& comm, void* buf, float* wide, int64_t count, DataType dtype,
                        ReduceOp op, double postscale, bool wide_partials, int64_t segment_bytes,
                        RingScratch* scratch) {
  if (wide == nullptr) {
    RingAllreduce(comm, buf, count, dtype, op, segment_bytes, scratch);
  } else if (wide_partials) {
    RingAllreduceWidened(comm, buf, wide, /*operands_in_wide=*/true, count, dtype, op,
                         Scale{1.0, postscale}, segment_bytes, scratch);
  } else {
    NarrowScaled(buf, wide, count, dtype, 1.0);
    RingAllreduce(comm, buf, count, dtype, op, segment_bytes, scratch);
    ScaleBuffer(buf, count, dtype, postscale);
  }
}

void RingReduceScatter(DataComm& comm, void* buf, const std::vector<int64_t>& starts,
                       DataType dtype, ReduceOp op, int64_t segment_bytes, RingScratch* scratch) {
  if (comm.size() == 1 || starts.back() == 0) return;
  ReduceScatterSteps(comm, static_cast<char*>(buf), starts.data(), dtype, op,
                     SegmentElems(segment_bytes, dtype), /*shift=*/0, scratch);
}

void RingAllgather(DataComm& comm, void* buf, const std::vector<int64_t>& starts, DataType dtype,
                   RingScratch* scratch) {
  if (comm.size() == 1 || starts.back() == 0) return;
  // Nothing is reduced, so nothing gains from small segments: each block
  // goes in pieces of the largest message the transport takes.
  AllgatherSteps(comm, static_cast<char*>(buf), starts.data(), dtype,
                 SegmentElems(DataComm::kMaxMessageBytes, dtype), /*shift=*/0, scratch);
}

}  // namespace hvdmx
