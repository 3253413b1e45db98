// Reading bytes that came from a peer: the one way the negotiation and the
// comm's collectives turn a message into values (the rule is written in
// csrc/hvdmx/README.md, "Peer input").
//
// Note [Peer input]
// ~~~~~~~~~~~~~~~~~
// A PeerInput reads one message that `from` sent, front to back. Each read
// checks the value against a bound that does not come from the message (the
// bytes that remain, the number of ranks, an enum's range, a flag's 0/1)
// before the caller may use it, and every count is capped by the bytes that
// remain over the smallest size an element takes on the wire, so nothing is
// allocated that the peer chose. The first value that fails throws
// PeerProtocolError naming the sender, the message, the field, the value and
// its bound (FailPeerInput), which the runtime turns into the job's failure
// (Runtime::StopAfterPeer): never an abort, never a read past the message.
//
// Threading: a PeerInput is a local of the thread that parses; it does not
// own the bytes, which must outlive it.
#ifndef HVDMX_PEER_INPUT_H_
#define HVDMX_PEER_INPUT_H_

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "comm/comm.h"

namespace hvdmx {

// Who sent the bytes being read: `rank` is what PeerGone::peer() reports
// (the rank in the comm that received them), `name` how a message names it
// ("rank 3", "local rank 1", TcpComm's "rank 3 (host h, ip:port)").
struct PeerSender {
  int rank = -1;
  std::string name;

  static PeerSender Rank(int rank) { return PeerSender{rank, "rank " + std::to_string(rank)}; }
};

// Throws PeerProtocolError: `from` sent `what` (a message and what is wrong
// with it), which the protocol does not allow. The one wording of the error,
// saying what it likely means and what to do.
[[noreturn]] void FailPeerInput(const PeerSender& from, const std::string& what);

class PeerInput {
 public:
  // Reads `bytes`, which `from` sent as `message` ("a request list").
  PeerInput(const std::string& bytes, PeerSender from, std::string message)
      : in_(bytes), from_(std::move(from)), message_(std::move(message)) {}

  const PeerSender& from() const { return from_; }
  size_t remaining() const { return in_.size() - pos_; }
  size_t position() const { return pos_; }
  bool done() const { return pos_ == in_.size(); }

  // The next sizeof(T) bytes as a T, any bit pattern allowed (a double, a
  // word of bits); `field` names it if they are not there.
  template <typename T>
  T Raw(const char* field) {
    static_assert(std::is_trivially_copyable<T>::value, "a value of plain bytes");
    Need(sizeof(T), field);
    T value;
    std::memcpy(&value, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return value;
  }
  // An integer of the wire's width (int32 or int64) in [lo, hi].
  int64_t Int32In(const char* field, int64_t lo, int64_t hi);
  int64_t Int64In(const char* field, int64_t lo, int64_t hi);
  // A flag written as one byte: 0 or 1.
  bool Flag(const char* field);
  // An int64 count of elements that each take at least `min_element_bytes`
  // on the wire: in [0, remaining() / min_element_bytes], and at most `most`.
  int64_t Count(const char* field, size_t min_element_bytes, int64_t most = INT64_MAX);
  // An int64 length, then that many bytes (at most `most`).
  std::string String(const char* field, int64_t most = INT64_MAX);
  // The next `n` bytes as they are (`n` a length already read and bounded,
  // or one that follows from this rank's own state); `field` names them if
  // fewer remain.
  std::string Bytes(size_t n, const char* field);
  // The same, passed over where the caller reads them in place.
  void Skip(size_t n, const char* field);
  // Nothing may follow the message's last field.
  void End();

  // Throws PeerProtocolError: this message has `problem` at the current
  // position. For the checks a format adds to the reads above.
  [[noreturn]] void Fail(const std::string& problem) const;

 private:
  void Need(size_t n, const char* field) const;
  // Int32In and Int64In: a `Wire` integer in [lo, hi].
  template <typename Wire>
  int64_t IntIn(const char* field, int64_t lo, int64_t hi);

  const std::string& in_;
  size_t pos_ = 0;
  PeerSender from_;
  std::string message_;
};

}  // namespace hvdmx

#endif  // HVDMX_PEER_INPUT_H_
