// The persistent fusion buffer: grown (and every page touched) only when a
// larger group first needs it, then reused for every call, so the data path
// allocates nothing. Used by the background thread only.
#ifndef HVDMX_FUSION_BUFFER_H_
#define HVDMX_FUSION_BUFFER_H_

#include <cstdint>
#include <memory>

namespace hvdmx {

class FusionBuffer {
 public:
  // At least `bytes` of 64-byte-aligned memory.
  char* Get(int64_t bytes);
  int64_t capacity() const { return capacity_; }

 private:
  struct Free {
    void operator()(char* p) const;
  };
  std::unique_ptr<char, Free> data_;
  int64_t capacity_ = 0;
};

}  // namespace hvdmx

#endif  // HVDMX_FUSION_BUFFER_H_
