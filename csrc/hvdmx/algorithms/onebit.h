// One-bit gradient compression with error feedback (Compression.onebit in
// hvdmx/compression.py): the kernels that pack a gradient into signs and a
// few scales, and that add up every rank's packed gradient. Pure functions
// on plain memory; no MXNet, no MPI.
//
// Note [One-bit compression]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Vocabulary: the residual is what this rank has not yet sent of its past
// gradients; a chunk is kOneBitChunk consecutive values (the last may be
// shorter). The packed form of n values is, per chunk, two float32s (their
// bits in a word each: the chunk's positive and negative level), then
// OneBitWords(n) words of signs, value i at bit i % 32 of word i / 32, 1 for
// >= 0.
// Pack: r = gradient + residual; in each chunk, the positive level is the
// mean of its values r_i >= 0 and the negative level the mean of the others
// (each summed in double, in index order; 0 when there are none); value i
// is sent as its chunk's level for its sign, and the residual keeps r_i
// minus what was sent. So each chunk's sum is sent exactly (up to rounding),
// and over any number of steps what was sent plus the residual is the sum of
// the gradients (up to float32 rounding): nothing is lost, only delayed.
// (One level per sign and chunk, as in 1-bit SGD (Seide et al., 2014),
// rather than one scale +-s per tensor: the digits example reached 0.90 test
// accuracy with the latter and ~0.97 with this.)
// Exchange (hvdmx/compression.py): an allgather of the packed words, then
// every rank decodes every rank's words and sums them in rank order with
// OneBitUnpackSum, so every rank computes the same bits.
// Bytes: 32/kOneBitChunk * 2 + 1 bits a value, 1.25 at a chunk of 256:
// 25.6x fewer than float32.
#ifndef HVDMX_ONEBIT_H_
#define HVDMX_ONEBIT_H_

#include <cstdint>

namespace hvdmx {

constexpr int64_t kOneBitChunk = 256;

// Words of the packed form of n values (levels, then signs).
inline int64_t OneBitPackedWords(int64_t n) {
  return 2 * ((n + kOneBitChunk - 1) / kOneBitChunk) + (n + 31) / 32;
}

// Packs `n` values of `gradient` plus `residual` into `packed`
// (OneBitPackedWords(n) words) and leaves in `residual` what was not sent.
// See Note [One-bit compression].
void OneBitPack(const float* gradient, float* residual, int64_t n, uint32_t* packed);

// out[i] = the sum over ranks 0, 1, ..., ranks-1 of what rank r's packed
// words (at packed + r * OneBitPackedWords(n)) send for value i, added in
// rank order in float32.
void OneBitUnpackSum(const uint32_t* packed, int ranks, int64_t n, float* out);

}  // namespace hvdmx

#endif  // HVDMX_ONEBIT_H_
