#include "platform/stage_stores.h"

#include <algorithm>
#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace hvdmx {

std::string StageStoresName(StageStores stores) {
  switch (stores) {
    case StageStores::kAuto: return "auto";
    case StageStores::kCached: return "0";
    case StageStores::kStreaming: return "1";
  }
  return "?";
}

int StageStoreChooser::SizeClass(int64_t bytes) const {
  if (bytes < min_bytes_) return -1;
  int c = 0;
  for (int64_t limit = min_bytes_ * 2; bytes >= limit && c + 1 < kClasses; limit *= 2) ++c;
  return c;
}

double StageStoreChooser::Samples::Best() const {
  const int n = std::min(count, kSamples);
  return *std::min_element(seconds_per_byte.begin(), seconds_per_byte.begin() + n);
}

bool StageStoreChooser::Streams(int64_t bytes) {
  if (stores_ != StageStores::kAuto) return stores_ == StageStores::kStreaming;
  const int c = SizeClass(bytes);
  if (c < 0) return false;
  Class& cls = classes_[c];
  const int64_t call = cls.calls++;
  // The warm-up, then kTrials of each kind.
  if (call == 0 || cls.kinds[0].count < kTrials) return false;
  if (cls.kinds[1].count < kTrials) return true;
  const bool faster = cls.kinds[1].Best() < cls.kinds[0].Best();
  const int64_t phase = call % kExploreEvery;
  if (phase < kExploreEvery - kTrials) return faster;
  // The window takes the kind that was slower when it began, all through.
  if (phase == kExploreEvery - kTrials) cls.explore_streaming = !faster;
  return cls.explore_streaming;
}

void StageStoreChooser::Took(int64_t bytes, bool streamed, double seconds) {
  if (stores_ != StageStores::kAuto) return;
  const int c = SizeClass(bytes);
  if (c < 0) return;
  Class& cls = classes_[c];
  if (cls.calls <= 1) return;  // the warm-up
  Samples& samples = cls.kinds[streamed ? 1 : 0];
  samples.seconds_per_byte[samples.count % kSamples] = seconds / static_cast<double>(bytes);
  ++samples.count;
}

#if defined(__x86_64__)

void StreamingCopy(void* dst_void, const void* src_void, int64_t bytes) {
  char* dst = static_cast<char*>(dst_void);
  const char* src = static_cast<const char*>(src_void);
  // Ordinary stores up to dst's first 16-byte boundary and after its last
  // whole 64 bytes; streaming stores (16-byte aligned) in between.
  const int64_t head = std::min<int64_t>(bytes, (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16);
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  bytes -= head;
  int64_t i = 0;
  for (; i + 64 <= bytes; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + i, src + i, bytes - i);
}

void StreamingStoresFence() { _mm_sfence(); }

#else

void StreamingCopy(void* dst, const void* src, int64_t bytes) { std::memcpy(dst, src, bytes); }
void StreamingStoresFence() {}

#endif

}  // namespace hvdmx
