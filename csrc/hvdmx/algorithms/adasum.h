// Adasum (Maleki et al., "Scaling Distributed Training with Adaptive
// Summation", MLSys 2021): the allreduce whose pairwise combination of two
// gradients a and b is
//
//   a (+) b = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b
//
// so that orthogonal gradients add and identical ones average. A coefficient
// whose norm |a|^2 is below kAdasumNormFloor stays 1, as Horovod's does.
// Each tensor is combined on its own: a fused buffer holds several tensors
// one after another, and the dot products and norms never cross their
// boundaries. Dots and norms are accumulated in float64; each combined
// element is computed in float64 and rounded once to the dtype.
//
// Vocabulary. The `group` is the ranks of the comm taking part, in order;
// a rank's index in it is its position. With p the largest power of two
// not above the group's size n:
//
//   fold     positions p..n-1 send their whole buffer to position - p,
//            which combines the two (its own as a) first; they take no
//            further part until the result comes back.
//   level k  (k = 0 .. log2(p)-1; distance d = 2^k) positions i and i^d
//            hold the same element range; the one with bit k clear keeps
//            the lower half and receives its partner's copy of it, the
//            other the upper half (vector halving, distance doubling).
//            The 2d positions that share i >> (k+1) hold the vectors being
//            combined at this level (a: bit k clear, b: set) in disjoint
//            pieces; they sum their partial dots and norms, per tensor, by
//            recursive doubling (every one gets the same bits), and each
//            combines its own piece.
//   gather   the levels in reverse: each position sends its piece to the
//            partner of that level and receives the partner's, until every
//            one of the p holds the whole result; then position i < n-p
//            sends it to i + p.
//
// So the result is the tree ((x0 (+) x1) (+) (x2 (+) x3)) ... over the
// folded inputs, each element computed once and copied: bitwise identical
// on every rank. Bytes each of the p positions sends: about 2 (p-1)/p times
// the buffer, plus 3 doubles per tensor and level per recursive-doubling
// step; a folded position sends and receives the buffer once more.
//
// Threading: whoever owns `comm` (the runtime's background thread).
#ifndef HVDMX_ADASUM_H_
#define HVDMX_ADASUM_H_

#include <cstdint>
#include <string>
#include <vector>

#include "base/common.h"
#include "comm/comm.h"
#include "comm/host_map.h"

namespace hvdmx {

constexpr double kAdasumNormFloor = 1e-8;

// Buffers reused between calls.
struct AdasumScratch {
  std::vector<char> received;   // the partner's half (or a folded position's whole buffer)
  std::vector<double> sums;     // per tensor: a.b, |a|^2, |b|^2
  std::vector<double> partner;  // the same, as a recursive-doubling partner sent them
  std::vector<int64_t> starts;  // where each tensor starts, in elements
};

// Whether Adasum combines `dtype` (float16, bfloat16, float32, float64).
bool AdasumSupports(DataType dtype);

// In place: `buf` holds the tensors of `counts`, one after another, of
// `dtype` (AdasumSupports). `group` lists the comm ranks taking part, this
// rank among them; empty means every rank of the comm in rank order. Every
// rank of the group calls it with the same counts and dtype.
void AdasumAllreduce(DataComm& comm, const std::vector<int>& group, void* buf,
                     const std::vector<int64_t>& counts, DataType dtype, AdasumScratch* scratch);

// The ranks the hierarchical Adasum makes `rank` talk to, given which
// ranks of the comm share a host (`hosts`, as the job found them at init):
// a host's leader and its other ranks, and the leaders that are partners in
// AdasumAllreduce over the leaders (folding, and halving at every
// distance). Symmetric. A data comm that does not link every pair adds
// these to its links when HVDMX_ADASUM_HIERARCHICAL=1 (Note [The data
// comm's links] in comm/p2p_comm.h): which ranks share a host is no
// function of the rank.
std::vector<int> AdasumHierarchicalPeers(const HostMap& hosts, int rank);

// The hierarchical variant (HVDMX_ADASUM_HIERARCHICAL=1), as Horovod's GPU
// Adasum: each host's ranks send their buffers to its leader, which sums
// them in rank order and divides by the host's rank count (the host's
// average); the leaders combine their averages by AdasumAllreduce; each
// leader sends the result back to its host's ranks. Bitwise identical on
// every rank as above; with one host it is the average. `hosts` says
// which ranks of the comm share a host.
void HierarchicalAdasumAllreduce(DataComm& comm, const HostMap& hosts, void* buf,
                                 const std::vector<int64_t>& counts, DataType dtype,
                                 AdasumScratch* scratch);

}  // namespace hvdmx

#endif  // HVDMX_ADASUM_H_
