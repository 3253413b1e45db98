// MXNet's 2-bit gradient compression (KVStore.set_gradient_compression(
// {'type': '2bit', 'threshold': t}) on hvd.KVStore), with MXNet's semantics:
// the kernels that quantize a gradient into 2-bit codes with a residual, and
// that add up every rank's codes. Pure functions on plain memory.
//
// Note [Two-bit compression]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// r = gradient + residual; value i is sent as +t where r_i >= t (and the
// residual keeps r_i - t), as -t where r_i <= -t (keeping r_i + t), and as 0
// elsewhere (keeping r_i): what MXNet's kvstore does with '2bit', so values
// beyond the threshold travel one threshold a step and the rest waits in
// the residual. The packed form of n values is one word holding t (a
// float32's bits, so that every rank decodes a peer's codes with the
// peer's threshold) and TwoBitWords(n) words of codes, value i at bits
// 2 (i % 16) and up of word i / 16: 0 for 0, 1 for +t, 2 for -t. 16x fewer
// bytes than float32. As with one bit, the codes are allgathered and every
// rank sums every rank's values in rank order (onebit.h).
#ifndef HVDMX_TWOBIT_H_
#define HVDMX_TWOBIT_H_

#include <cstdint>

namespace hvdmx {

inline int64_t TwoBitPackedWords(int64_t n) { return 1 + (n + 15) / 16; }

void TwoBitPack(const float* gradient, float* residual, int64_t n, float threshold,
                uint32_t* packed);

// out[i] = the sum over ranks 0, 1, ..., ranks-1 of what rank r's packed
// words (at packed + r * TwoBitPackedWords(n)) send for value i.
void TwoBitUnpackSum(const uint32_t* packed, int ranks, int64_t n, float* out);

}  // namespace hvdmx

#endif  // HVDMX_TWOBIT_H_
