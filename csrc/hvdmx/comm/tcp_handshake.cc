#include "comm/tcp_handshake.h"

#include <cstring>

#include "base/common.h"
#include "base/crypto.h"

namespace hvdmx {
namespace {

// "HVDX", then the protocol's version: a peer of another version is
// dropped as bytes that are not ours.
constexpr char kMagic[8] = {'H', 'V', 'D', 'X', 't', 'c', 'p', '1'};

void PutU32(std::string* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint32_t GetU32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i)
    v |= static_cast<uint32_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

}  // namespace

Handshake::Handshake(const TcpIdentity& identity, Role role, int self, int peer)
    : identity_(identity),
      role_(role),
      self_(self),
      peer_(peer),
      step_(role == Role::kConnector ? Step::kChallenge : Step::kHello) {}

Handshake Handshake::Connector(const TcpIdentity& identity, int self, int size, int peer) {
  HVDMX_CHECK(self >= 0 && self < peer && peer < size,
              "a connector's ranks: " + std::to_string(self) + " to " + std::to_string(peer));
  Handshake h(identity, Role::kConnector, self, peer);
  h.connector_nonce_ = RandomBytes(kNonceBytes);
  h.output_.assign(kMagic, sizeof(kMagic));
  h.output_ += identity.comm_id;
  PutU32(&h.output_, identity.generation);
  PutU32(&h.output_, static_cast<uint32_t>(self));
  PutU32(&h.output_, static_cast<uint32_t>(peer));
  h.output_ += h.connector_nonce_;
  return h;
}

const std::string& Handshake::Refusal() {
  static const std::string refusal = [] {
    std::string r = "HVDX: your proof of the key does not verify";
    r.resize(kProofBytes, '.');
    return r;
  }();
  return refusal;
}

Handshake Handshake::Acceptor(const TcpIdentity& identity, int self) {
  return Handshake(identity, Role::kAcceptor, self, -1);
}

size_t Handshake::want() const {
  if (state_ != State::kRunning || !output_.empty()) return 0;
  size_t total = 0;
  switch (step_) {
    case Step::kHello: total = kHelloBytes; break;
    case Step::kChallenge: total = kChallengeBytes; break;
    case Step::kProof: total = kProofBytes; break;
    case Step::kFinished: return 0;
  }
  return total - input_.size();
}

void Handshake::Feed(const char* data, size_t bytes) {
  if (bytes > want()) {
    Reject("more bytes than the handshake reads", false);
    return;
  }
  input_.append(data, bytes);
  if (want() > 0) return;
  switch (step_) {
    case Step::kHello: OnHello(); break;
    case Step::kChallenge: OnChallenge(); break;
    case Step::kProof: OnProof(); break;
    case Step::kFinished: break;
  }
  input_.clear();
}

std::string Handshake::Transcript() const {
  const int connector = role_ == Role::kConnector ? self_ : peer_;
  const int acceptor = role_ == Role::kConnector ? peer_ : self_;
  std::string t = connector_nonce_ + acceptor_nonce_ + identity_.comm_id;
  PutU32(&t, identity_.generation);
  PutU32(&t, static_cast<uint32_t>(connector));
  PutU32(&t, static_cast<uint32_t>(acceptor));
  return t;
}

void Handshake::Reject(const std::string& why, bool wrong_key) {
  state_ = State::kRejected;
  wrong_key_ = wrong_key;
  why_ = why;
  output_.clear();
}

void Handshake::OnHello() {
  const char* p = input_.data();
  if (std::memcmp(p, kMagic, sizeof(kMagic)) != 0) {
    return Reject("its first bytes are not an hvdmx hello of this version", false);
  }
  p += sizeof(kMagic);
  if (std::string(p, kCommIdBytes) != identity_.comm_id) {
    return Reject("its hello names another communicator or job", false);
  }
  p += kCommIdBytes;
  const uint32_t generation = GetU32(p);
  const uint32_t from = GetU32(p + 4);
  const uint32_t to = GetU32(p + 8);
  if (generation != identity_.generation) {
    return Reject("its hello is for generation " + std::to_string(generation) + ", not " +
                      std::to_string(identity_.generation),
                  false);
  }
  if (to != static_cast<uint32_t>(self_) || from >= static_cast<uint32_t>(self_)) {
    return Reject("its hello claims rank " + std::to_string(from) + " connecting to rank " +
                      std::to_string(to) + ", which is not a lower rank connecting to this one",
                  false);
  }
  peer_ = static_cast<int>(from);
  connector_nonce_.assign(p + 12, kNonceBytes);
  acceptor_nonce_ = RandomBytes(kNonceBytes);
  output_ = acceptor_nonce_ + HmacSha256(identity_.key, "A" + Transcript());
  step_ = Step::kProof;
}

void Handshake::OnChallenge() {
  acceptor_nonce_ = input_.substr(0, kNonceBytes);
  const std::string theirs = input_.substr(kNonceBytes);
  if (!SameBytesConstantTime(theirs, HmacSha256(identity_.key, "A" + Transcript()))) {
    Reject("its proof of the job's key does not verify", true);
    output_ = Refusal();  // so that a rank with another key learns why
    return;
  }
  output_ = HmacSha256(identity_.key, "C" + Transcript());
  step_ = Step::kFinished;
  state_ = State::kDone;
}

void Handshake::OnProof() {
  if (input_ == Refusal()) {
    return Reject("it refused this rank's proof of the job's key, which did not verify", true);
  }
  if (!SameBytesConstantTime(input_, HmacSha256(identity_.key, "C" + Transcript()))) {
    return Reject("its proof of the job's key does not verify", true);
  }
  step_ = Step::kFinished;
  state_ = State::kDone;
}

}  // namespace hvdmx
