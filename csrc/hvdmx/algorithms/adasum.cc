#include "algorithms/adasum.h"

#include <algorithm>
#include <cstring>

#include "algorithms/reduce_kernels.h"
#include "base/float_formats.h"
#include "comm/p2p_comm.h"

namespace hvdmx {
namespace {

// Sends `send_bytes` from `send` to `peer` while receiving `recv_bytes`
// from it into `recv`, in messages of at most DataComm::kMaxMessageBytes; the
// peer makes the mirror call. Either side may be empty.
void Exchange(DataComm& comm, int peer, const void* send, int64_t send_bytes, void* recv,
              int64_t recv_bytes) {
  std::vector<DataComm::Request> requests;
  PostRecvPieces(comm, static_cast<char*>(recv), recv_bytes, peer, &requests);
  PostSendPieces(comm, static_cast<const char*>(send), send_bytes, peer, &requests);
  for (DataComm::Request request : requests) comm.Wait(request);
}

// Elements [lo, hi) of the fused buffer.
struct Range {
  int64_t lo = 0;
  int64_t hi = 0;
  int64_t size() const { return hi - lo; }
};

// The pairwise step on one format F (float_formats.h): a and b are pieces
// of the two vectors being combined, the same elements of each.
template <typename F>
struct Pairwise {
  using T = typename F::Storage;

  static double Load(T x) { return static_cast<double>(F::Load(x)); }

  // sums[0] += a.b, sums[1] += |a|^2, sums[2] += |b|^2, in float64.
  static void Dots(const T* a, const T* b, int64_t n, double* sums) {
    double dot = 0, aa = 0, bb = 0;
    for (int64_t i = 0; i < n; ++i) {
      const double x = Load(a[i]);
      const double y = Load(b[i]);
      dot += x * y;
      aa += x * x;
      bb += y * y;
    }
    sums[0] += dot;
    sums[1] += aa;
    sums[2] += bb;
  }

  // out[i] = ca a[i] + cb b[i], computed in float64 and stored in T (float16
  // and bfloat16 through float32). out may be a or b.
  static void Combine(T* out, const T* a, const T* b, int64_t n, double ca, double cb) {
    for (int64_t i = 0; i < n; ++i) {
      out[i] = F::Store(static_cast<typename F::Compute>(ca * Load(a[i]) + cb * Load(b[i])));
    }
  }
};

// The coefficient of a vector whose squared norm is `own` in a (+) b.
double Coefficient(double dot, double own) {
  return own >= kAdasumNormFloor ? 1.0 - dot / own * 0.5 : 1.0;
}

template <typename F>
class Run {
 public:
  using T = typename F::Storage;
  using P = Pairwise<F>;

  Run(DataComm& comm, const std::vector<int>& group, T* buf, const std::vector<int64_t>& counts,
      AdasumScratch* scratch)
      : comm_(comm), group_(group), buf_(buf), scratch_(*scratch) {
    std::vector<int64_t>& starts = scratch_.starts;
    starts.assign(1, 0);
    for (int64_t count : counts) starts.push_back(starts.back() + count);
    tensors_ = static_cast<int>(counts.size());
    total_ = starts.back();
    n_ = static_cast<int>(group_.size());
    me_ = static_cast<int>(std::find(group_.begin(), group_.end(), comm.rank()) - group_.begin());
    HVDMX_CHECK(me_ < n_, "Adasum: this rank is not in its group");
    p_ = 1;
    while (p_ * 2 <= n_) p_ *= 2;
  }

  void Execute() {
    if (n_ == 1 || total_ == 0) return;
    const int64_t bytes = total_ * static_cast<int64_t>(sizeof(T));
    if (me_ >= p_) {  // folded: hand the buffer over, get the result back
      Exchange(comm_, group_[me_ - p_], buf_, bytes, nullptr, 0);
      Exchange(comm_, group_[me_ - p_], nullptr, 0, buf_, bytes);
      return;
    }
    const bool folds = me_ < n_ - p_;
    if (folds) {
      T* extra = Received(total_);
      Exchange(comm_, group_[me_ + p_], nullptr, 0, extra, bytes);
      std::vector<double>& sums = scratch_.sums;
      sums.assign(3 * static_cast<size_t>(tensors_), 0.0);
      ForEachTensor(Range{0, total_}, [&](int t, Range piece) {
        P::Dots(buf_ + piece.lo, extra + piece.lo, piece.size(), &sums[3 * t]);
      });
      CombineRange(Range{0, total_}, buf_, extra);
    }
    std::vector<Range> before, kept;
    Range range{0, total_};
    for (int d = 1; d < p_; d *= 2) {
      const bool lower = (me_ & d) == 0;
      const int64_t mid = range.lo + range.size() / 2;
      const Range keep = lower ? Range{range.lo, mid} : Range{mid, range.hi};
      const Range give = lower ? Range{mid, range.hi} : Range{range.lo, mid};
      T* theirs = Received(keep.size());
      Exchange(comm_, group_[me_ ^ d], buf_ + give.lo, give.size() * sizeof(T), theirs,
               keep.size() * sizeof(T));
      // Both pieces are indexed from keep.lo: shift the received one.
      const T* a = lower ? buf_ : theirs - keep.lo;
      const T* b = lower ? theirs - keep.lo : buf_;
      std::vector<double>& sums = scratch_.sums;
      sums.assign(3 * static_cast<size_t>(tensors_), 0.0);
      ForEachTensor(keep, [&](int t, Range piece) {
        P::Dots(a + piece.lo, b + piece.lo, piece.size(), &sums[3 * t]);
      });
      SumOverLevelGroup(d);
      CombineRange(keep, a, b);
      before.push_back(range);
      kept.push_back(keep);
      range = keep;
    }
    for (int k = static_cast<int>(kept.size()) - 1; k >= 0; --k) {
      const Range keep = kept[k];
      const Range whole = before[k];
      const Range other = keep.lo == whole.lo ? Range{keep.hi, whole.hi} : Range{whole.lo, keep.lo};
      Exchange(comm_, group_[me_ ^ (1 << k)], buf_ + keep.lo, keep.size() * sizeof(T),
               buf_ + other.lo, other.size() * sizeof(T));
    }
    if (folds) Exchange(comm_, group_[me_ + p_], buf_, bytes, nullptr, 0);
  }

 private:
  // The received elements' buffer, for `count` of them.
  T* Received(int64_t count) {
    scratch_.received.resize(std::max<size_t>(scratch_.received.size(), count * sizeof(T)));
    return reinterpret_cast<T*>(scratch_.received.data());
  }

  // f(tensor, the part of `range` in it) for each tensor `range` meets.
  template <typename Fn>
  void ForEachTensor(Range range, Fn&& f) const {
    const std::vector<int64_t>& starts = scratch_.starts;
    // The first tensor that ends after range.lo.
    int t = static_cast<int>(std::upper_bound(starts.begin() + 1, starts.end(), range.lo) -
                             starts.begin()) -
            1;
    for (; t < tensors_ && starts[t] < range.hi; ++t) {
      const Range piece{std::max(starts[t], range.lo), std::min(starts[t + 1], range.hi)};
      if (piece.size() > 0) f(t, piece);
    }
  }

  // buf_[range] = a (+) b per tensor, from the dots and norms in sums; a and
  // b are indexed like buf_.
  void CombineRange(Range range, const T* a, const T* b) {
    const std::vector<double>& sums = scratch_.sums;
    ForEachTensor(range, [&](int t, Range piece) {
      const double dot = sums[3 * t];
      P::Combine(buf_ + piece.lo, a + piece.lo, b + piece.lo, piece.size(),
                 Coefficient(dot, sums[3 * t + 1]), Coefficient(dot, sums[3 * t + 2]));
    });
  }

  // Sums scratch_.sums over the 2d positions that share me_ / (2d), by
  // recursive doubling: each pair adds the same two operands (addition
  // commutes bit for bit), so all of them end with the same bits.
  void SumOverLevelGroup(int d) {
    std::vector<double>& sums = scratch_.sums;
    std::vector<double>& partner = scratch_.partner;
    partner.resize(sums.size());
    const int64_t bytes = static_cast<int64_t>(sums.size() * sizeof(double));
    for (int e = 1; e <= d; e *= 2) {
      Exchange(comm_, group_[me_ ^ e], sums.data(), bytes, partner.data(), bytes);
      for (size_t i = 0; i < sums.size(); ++i) sums[i] += partner[i];
    }
  }

  DataComm& comm_;
  const std::vector<int>& group_;
  T* buf_;
  AdasumScratch& scratch_;
  int tensors_ = 0;
  int64_t total_ = 0;
  int n_ = 0;   // positions in the group
  int me_ = 0;  // this rank's
  int p_ = 1;   // the largest power of two <= n_
};

template <typename F>
void RunOn(DataComm& comm, const std::vector<int>& group, void* buf,
           const std::vector<int64_t>& counts, AdasumScratch* scratch) {
  Run<F>(comm, group, static_cast<typename F::Storage*>(buf), counts, scratch).Execute();
}

}  // namespace

bool AdasumSupports(DataType dtype) {
  return dtype == DataType::kFloat16 || dtype == DataType::kBFloat16 ||
         dtype == DataType::kFloat32 || dtype == DataType::kFloat64;
}

void AdasumAllreduce(DataComm& comm, const std::vector<int>& group, void* buf,
                     const std::vector<int64_t>& counts, DataType dtype, AdasumScratch* scratch) {
  std::vector<int> everyone;
  if (group.empty()) {
    for (int r = 0; r < comm.size(); ++r) everyone.push_back(r);
  }
  const std::vector<int>& ranks = group.empty() ? everyone : group;
  switch (dtype) {
    case DataType::kFloat16: return RunOn<fp::Float16>(comm, ranks, buf, counts, scratch);
    case DataType::kBFloat16: return RunOn<fp::BFloat16>(comm, ranks, buf, counts, scratch);
    case DataType::kFloat32: return RunOn<fp::Float32>(comm, ranks, buf, counts, scratch);
    case DataType::kFloat64: return RunOn<fp::Float64>(comm, ranks, buf, counts, scratch);
    default: break;
  }
  HVDMX_CHECK(false, "Adasum of " + DataTypeName(dtype) + " (the Python layer refuses it)");
}

std::vector<int> AdasumHierarchicalPeers(const HostMap& hosts, int rank) {
  const std::vector<int>& mine = hosts.host_ranks(rank);
  const int leader = mine.front();
  if (rank != leader) return {leader};
  std::vector<int> peers(mine.begin() + 1, mine.end());
  // AdasumAllreduce's partners among the leaders (Run::Execute folds and
  // halves as the bit-and doubles).
  const std::vector<int> group = hosts.leaders();
  const int me = static_cast<int>(std::find(group.begin(), group.end(), rank) - group.begin());
  for (int j : P2PComm::DoublingPartners(me, static_cast<int>(group.size()))) {
    peers.push_back(group[j]);
  }
  std::sort(peers.begin(), peers.end());
  return peers;
}

void HierarchicalAdasumAllreduce(DataComm& comm, const HostMap& hosts, void* buf,
                                 const std::vector<int64_t>& counts, DataType dtype,
                                 AdasumScratch* scratch) {
  int64_t total = 0;
  for (int64_t count : counts) total += count;
  const int64_t bytes = total * static_cast<int64_t>(DataTypeSize(dtype));
  const std::vector<int>& mine = hosts.host_ranks(comm.rank());
  const int leader = mine.front();
  if (comm.rank() != leader) {
    Exchange(comm, leader, buf, bytes, nullptr, 0);
    Exchange(comm, leader, nullptr, 0, buf, bytes);
    return;
  }
  scratch->received.resize(std::max<size_t>(scratch->received.size(), bytes));
  for (size_t i = 1; i < mine.size(); ++i) {
    Exchange(comm, mine[i], nullptr, 0, scratch->received.data(), bytes);
    ReduceInto(buf, scratch->received.data(), total, dtype, ReduceOp::kSum);
  }
  ScaleBuffer(buf, total, dtype, 1.0 / static_cast<double>(mine.size()));
  AdasumAllreduce(comm, hosts.leaders(), buf, counts, dtype, scratch);
  for (size_t i = 1; i < mine.size(); ++i) {
    Exchange(comm, mine[i], buf, bytes, nullptr, 0);
  }
}

}  // namespace hvdmx
