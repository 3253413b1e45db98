// See peer_input.h, Note [Peer input].
#include "comm/peer_input.h"

#include <algorithm>
#include <cstdint>

namespace hvdmx {

void FailPeerInput(const PeerSender& from, const std::string& what) {
  throw PeerProtocolError(
      from.rank, "hvdmx: " + from.name + " sent " + what +
                     ", which the protocol does not allow: the ranks likely run different "
                     "versions of hvdmx, or the bytes were corrupted on the way. hvdmx has "
                     "stopped on this rank: end the job and look at the other ranks' output "
                     "(see docs/errors.md)");
}

void PeerInput::Fail(const std::string& problem) const {
  FailPeerInput(from_, message_ + " of " + std::to_string(in_.size()) + " bytes with " + problem +
                           " (at byte " + std::to_string(pos_) + ")");
}

void PeerInput::Need(size_t n, const char* field) const {
  if (n > remaining()) {
    Fail(std::string("its ") + field + " cut short: " + std::to_string(n) + " bytes needed, " +
         std::to_string(remaining()) + " left");
  }
}

template <typename Wire>
int64_t PeerInput::IntIn(const char* field, int64_t lo, int64_t hi) {
  const int64_t v = Raw<Wire>(field);
  if (v < lo || v > hi) {
    pos_ -= sizeof(Wire);
    Fail(std::string(field) + " " + std::to_string(v) + ", outside [" + std::to_string(lo) + ", " +
         std::to_string(hi) + "]");
  }
  return v;
}

int64_t PeerInput::Int32In(const char* field, int64_t lo, int64_t hi) {
  return IntIn<int32_t>(field, lo, hi);
}

int64_t PeerInput::Int64In(const char* field, int64_t lo, int64_t hi) {
  return IntIn<int64_t>(field, lo, hi);
}

bool PeerInput::Flag(const char* field) {
  const uint8_t v = Raw<uint8_t>(field);
  if (v > 1) {
    pos_ -= 1;
    Fail(std::string("flag ") + field + " " + std::to_string(v) + ", where 0 or 1 was expected");
  }
  return v == 1;
}

int64_t PeerInput::Count(const char* field, size_t min_element_bytes, int64_t most) {
  const int64_t v = Raw<int64_t>(field);
  const int64_t fit = static_cast<int64_t>(remaining() / min_element_bytes);
  const int64_t bound = std::min(fit, most);
  if (v < 0 || v > bound) {
    pos_ -= sizeof(int64_t);
    Fail(std::string("a count of ") + field + " of " + std::to_string(v) + ", outside [0, " +
         std::to_string(bound) + "] (" + std::to_string(remaining() - sizeof(int64_t)) +
         " bytes follow, each element takes at least " + std::to_string(min_element_bytes) + ")");
  }
  return v;
}

std::string PeerInput::String(const char* field, int64_t most) {
  const int64_t n = Count(field, 1, most);
  return Bytes(static_cast<size_t>(n), field);
}

std::string PeerInput::Bytes(size_t n, const char* field) {
  Need(n, field);
  std::string s = in_.substr(pos_, n);
  pos_ += n;
  return s;
}

void PeerInput::Skip(size_t n, const char* field) {
  Need(n, field);
  pos_ += n;
}

void PeerInput::End() {
  if (!done()) Fail(std::to_string(remaining()) + " bytes after its last field");
}

}  // namespace hvdmx
