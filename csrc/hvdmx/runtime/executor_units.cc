// The units that are not allreduces: broadcast, allgather, alltoall and
// reducescatter, each one response (one call, or one grouped call) at a
// time. Executor::RunUnit (executor.cc) picks the function; each returns
// the algorithm's name for the timeline. What each moves, and how the
// transport is chosen, is in docs/algorithms.md ("Broadcast, allgather and
// alltoall on one host" and the sections before it).
#include "runtime/executor.h"

#include <algorithm>
#include <cstring>

#include "algorithms/bruck.h"
#include "algorithms/reduce_kernels.h"

namespace hvdmx {

namespace {

// Elements per row: the product of every dimension but the first.
int64_t RowElems(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

}  // namespace

const char* Executor::RunBroadcast(const Response& response, TensorEntry& entry) {
  const bool shm = ShmMoves(CollectiveType::kBroadcast, UnitBytes(response));
  for (size_t t = 0; t < response.counts.size(); ++t) {
    const int64_t bytes =
        response.counts[t] * static_cast<int64_t>(DataTypeSize(response.dtypes[t]));
    if (bytes == 0) continue;
    if (shm) {
      shm_->exchange().Broadcast(entry.inputs[t], entry.outputs[t], bytes, response.root);
      continue;
    }
    if (comm_.rank() == response.root && entry.outputs[t] != entry.inputs[t]) {
      std::memcpy(entry.outputs[t], entry.inputs[t], bytes);
    }
    mpi_pages_.Collapse(entry.outputs[t], bytes);
    comm_.Bcast(entry.outputs[t], bytes, response.root);
  }
  return shm ? "SHM_BCAST" : "MPI_BCAST";
}

// Each rank's rows travel as one block of bytes. A tensor whose output is
// larger than HVDMX_FUSION_MAX_TENSOR_BYTES moves alone, straight into its
// output: packing it would copy it twice more. The others, if there are two
// or more and their output is at most HVDMX_FUSION_THRESHOLD in all, are
// packed by rank ([rank 0: t0, t1, ...][rank 1: ...]) in the fusion buffer
// and move in one exchange after the lone ones; otherwise they move alone
// too. Measured: "Grouped allgather" in docs/benchmark-notes.md.
const char* Executor::RunAllgather(const Response& response, TensorEntry& entry) {
  const int n = comm_.size();
  const int me = comm_.rank();
  const size_t tensors = response.dtypes.size();
  // Bytes of tensor t's rows on rank r.
  auto block = [&](size_t t, int r) {
    return response.splits[t * n + r] * RowElems(entry.request.shapes[t]) *
           static_cast<int64_t>(DataTypeSize(response.dtypes[t]));
  };
  int64_t total = 0;
  int64_t packed_bytes = 0;
  packed_.clear();
  for (size_t t = 0; t < tensors; ++t) {
    int64_t out = 0;
    for (int r = 0; r < n; ++r) out += block(t, r);
    total += out;
    if (out <= config_.fusion_max_tensor_bytes) {
      packed_.push_back(t);
      packed_bytes += out;
    }
  }
  if (packed_.size() < 2 || packed_bytes > config_.fusion_threshold) packed_.clear();
  const bool shm = ShmMoves(CollectiveType::kAllgather, total);
  // A lone tensor's output comes from the output pool: where the ranks write
  // into each other's outputs, it moves in one copy through shared memory at
  // any size, faster than the ring, whose cross-memory attach pins the
  // shared file's small pages (docs/benchmark-notes.md, "Large allgathers
  // written into the peers' outputs").
  const bool shm_lone = shm || (shm_ != nullptr && shm_->exchange().writes_into_peers() &&
                                ShmMoves(CollectiveType::kAllgather, 0));
  const char* algorithm = shm_lone ? "SHM_ALLGATHER" : "RING_ALLGATHER";

  tensor_starts_.resize(n + 1);
  size_t next_packed = 0;
  for (size_t t = 0; t < tensors; ++t) {
    if (next_packed < packed_.size() && packed_[next_packed] == t) {
      ++next_packed;
      continue;
    }
    tensor_starts_[0] = 0;
    for (int r = 0; r < n; ++r) tensor_starts_[r + 1] = tensor_starts_[r] + block(t, r);
    char* out = static_cast<char*>(entry.outputs[t]);
    if (shm_lone) {
      shm_->exchange().Allgather(entry.inputs[t], out, tensor_starts_);
      continue;
    }
    if (block(t, me)) std::memcpy(out + tensor_starts_[me], entry.inputs[t], block(t, me));
    mpi_pages_.Collapse(out, tensor_starts_[n]);
    RingAllgather(comm_, out, tensor_starts_, DataType::kUInt8, &ring_scratch_);
  }
  if (packed_.empty()) return algorithm;

  starts_.assign(n + 1, 0);
  for (int r = 0; r < n; ++r) {
    starts_[r + 1] = starts_[r];
    for (size_t t : packed_) starts_[r + 1] += block(t, r);
  }
  char* buffer = fusion_.Get(starts_[n]);
  int64_t offset = starts_[me];
  for (size_t t : packed_) {
    if (block(t, me)) std::memcpy(buffer + offset, entry.inputs[t], block(t, me));
    offset += block(t, me);
  }
  if (shm) {
    shm_->exchange().Allgather(buffer + starts_[me], buffer, starts_);
  } else {
    mpi_pages_.Collapse(buffer, starts_[n]);
    RingAllgather(comm_, buffer, starts_, DataType::kUInt8, &ring_scratch_);
  }
  // Unpack: tensor_starts_[i] counts what packed tensor i has received.
  tensor_starts_.assign(packed_.size(), 0);
  offset = 0;
  for (int r = 0; r < n; ++r) {
    for (size_t i = 0; i < packed_.size(); ++i) {
      const int64_t bytes = block(packed_[i], r);
      if (bytes) {
        std::memcpy(static_cast<char*>(entry.outputs[packed_[i]]) + tensor_starts_[i],
                    buffer + offset, bytes);
      }
      tensor_starts_[i] += bytes;
      offset += bytes;
    }
  }
  return algorithm;
}

// Every pair exchanges its rows directly where the comm links every pair,
// else by Bruck's algorithm through the ranks it links with (Alltoall in
// algorithms/bruck.h). In shared memory, each rank publishes its input
// without the rows it keeps and reads its rows from every peer's.
const char* Executor::RunAlltoall(const Response& response, TensorEntry& entry) {
  const int n = comm_.size();
  const int me = comm_.rank();
  const int64_t row_bytes =
      RowElems(entry.request.shapes[0]) * static_cast<int64_t>(DataTypeSize(response.dtypes[0]));
  const std::vector<int64_t>& m = response.splits;  // rows i sends to j at [i * n + j]
  char* in = static_cast<char*>(const_cast<void*>(entry.inputs[0]));
  char* out = static_cast<char*>(entry.outputs[0]);
  int64_t total = 0;
  for (int64_t rows : m) total += rows * row_bytes;
  pair_bytes_.resize(m.size());
  for (size_t i = 0; i < m.size(); ++i) pair_bytes_[i] = m[i] * row_bytes;
  if (ShmMoves(CollectiveType::kAlltoall, total)) {
    shm_->exchange().Alltoall(in, out, pair_bytes_);
    return "SHM_ALLTOALL";
  }
  int64_t sent = 0;  // the bytes of `in`
  for (int j = 0; j < n; ++j) sent += pair_bytes_[static_cast<size_t>(me) * n + j];
  mpi_pages_.Collapse(in, sent);
  Alltoall(comm_, in, out, pair_bytes_, &alltoall_scratch_);
  return "MPI_ALLTOALL";
}

// Rank r keeps rows [RingChunkStart(dim0, n, r), RingChunkStart(dim0, n, r+1))
// of the reduction, so the first ranks get the remainder. Tensors of one
// dtype are packed by rank ([rank 0's rows of t0, t1, ...][rank 1's ...]) and
// reduce-scattered together; the reduction is the ring's, computed once per
// element, so every rank's share is bitwise what the others would compute.
// On one host the tensors go through shared memory instead, one at a time
// (reduced once per element too, in rank order), unless they have a prescale.
const char* Executor::RunReducescatter(const Response& response, TensorEntry& entry) {
  const int n = comm_.size();
  const int me = comm_.rank();
  Scale scale = response.scale;
  if (response.op == ReduceOp::kAverage) scale.post /= n;
  const size_t tensors = response.dtypes.size();
  const char* algorithm = "RING_REDUCESCATTER";
  std::vector<bool> done(tensors, false);
  for (size_t lead = 0; lead < tensors; ++lead) {
    if (done[lead]) continue;
    const DataType dtype = response.dtypes[lead];
    const int64_t elem = static_cast<int64_t>(DataTypeSize(dtype));
    std::vector<size_t> members;
    for (size_t t = lead; t < tensors; ++t) {
      if (!done[t] && response.dtypes[t] == dtype) {
        members.push_back(t);
        done[t] = true;
      }
    }
    // Elements of tensor t's rows that rank r keeps, and where they start.
    auto rows_begin = [&](size_t t, int r) {
      return RingChunkStart(entry.request.shapes[t][0], n, r) * RowElems(entry.request.shapes[t]);
    };
    starts_.assign(n + 1, 0);
    for (int r = 0; r < n; ++r) {
      starts_[r + 1] = starts_[r];
      for (size_t t : members) starts_[r + 1] += rows_begin(t, r + 1) - rows_begin(t, r);
    }
    // Through shared memory each tensor is reduced straight from its input
    // into its output, one after another. (A prescale would have to write
    // the input.)
    if (scale.pre == 1.0 && n > 1 && ShmMoves(CollectiveType::kReducescatter, starts_[n] * elem) &&
        shm_->allreduce().ReduceScatterFits(dtype)) {
      tensor_starts_.resize(n + 1);
      for (size_t t : members) {
        for (int r = 0; r <= n; ++r) tensor_starts_[r] = rows_begin(t, r);
        shm_->allreduce().ReduceScatter(entry.inputs[t], entry.outputs[t], tensor_starts_, dtype,
                                        response.op, scale.post);
      }
      algorithm = "SHM_REDUCESCATTER";
      continue;
    }
    // On the ring the input goes through the fusion buffer (the ring works
    // in place), a piece at a time (PieceBytes, plus at most an element a
    // rank): piece p takes the p-th of `pieces` near-equal parts of every
    // rank's block. An element stays in its block, so it is reduced in the
    // same order as in one pass.
    const int64_t piece_elems = std::max<int64_t>(PieceBytes() / elem, 1);
    const int64_t pieces = std::max<int64_t>(1, (starts_[n] + piece_elems - 1) / piece_elems);
    // Calls f(t, first, at, count) for each member's share of elements
    // [lo, hi) of rank r's block (members' rows for r, one after another):
    // `count` elements from element `first` of tensor t's rows for r, at
    // `at` in the range.
    auto for_range = [&](int r, int64_t lo, int64_t hi, auto&& f) {
      int64_t begin = 0;  // where tensor t's rows start in the block
      for (size_t t : members) {
        const int64_t len = rows_begin(t, r + 1) - rows_begin(t, r);
        const int64_t a = std::max(lo, begin), b = std::min(hi, begin + len);
        if (a < b) f(t, a - begin, a - lo, b - a);
        begin += len;
      }
    };
    // Piece p's part of rank r's block starts here.
    auto part = [&](int r, int64_t p) {
      return RingChunkStart(starts_[r + 1] - starts_[r], pieces, p);
    };
    piece_starts_.assign(n + 1, 0);
    for (int64_t p = 0; p < pieces; ++p) {
      for (int r = 0; r < n; ++r) {
        piece_starts_[r + 1] = piece_starts_[r] + part(r, p + 1) - part(r, p);
      }
      char* buffer = fusion_.Get(piece_starts_[n] * elem);
      for (int r = 0; r < n; ++r) {
        char* to = buffer + piece_starts_[r] * elem;
        for_range(
            r, part(r, p), part(r, p + 1), [&](size_t t, int64_t first, int64_t at, int64_t count) {
              std::memcpy(
                  to + at * elem,
                  static_cast<const char*>(entry.inputs[t]) + (rows_begin(t, r) + first) * elem,
                  count * elem);
            });
      }
      char* mine = buffer + piece_starts_[me] * elem;
      const int64_t mine_count = piece_starts_[me + 1] - piece_starts_[me];
      if (HalfReducesWide(dtype) && config_.half_partials_wide) {
        // float32 partials, rounded once (Note [Half precision summed in
        // float32] in reduce_kernels.cc).
        auto* wide = reinterpret_cast<float*>(wide_.Get(piece_starts_[n] * 4));
        WidenScaled(wide, buffer, piece_starts_[n], dtype, scale.pre);
        mpi_pages_.Collapse(wide, piece_starts_[n] * 4);
        RingReduceScatter(comm_, wide, piece_starts_, DataType::kFloat32, response.op,
                          config_.ring_segment_bytes, &ring_scratch_);
        NarrowScaled(mine, wide + piece_starts_[me], mine_count, dtype, scale.post);
      } else {
        ScaleBuffer(buffer, piece_starts_[n], dtype, scale.pre);
        mpi_pages_.Collapse(buffer, piece_starts_[n] * elem);
        RingReduceScatter(comm_, buffer, piece_starts_, dtype, response.op,
                          config_.ring_segment_bytes, &ring_scratch_);
        ScaleBuffer(mine, mine_count, dtype, scale.post);
      }
      for_range(me, part(me, p), part(me, p + 1),
                [&](size_t t, int64_t first, int64_t at, int64_t count) {
                  std::memcpy(static_cast<char*>(entry.outputs[t]) + first * elem, mine + at * elem,
                              count * elem);
                });
    }
  }
  return algorithm;
}

}  // namespace hvdmx
