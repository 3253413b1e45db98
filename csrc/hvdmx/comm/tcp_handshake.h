// The handshake that opens every TCP connection between two ranks: who is
// connecting, to which communicator, and the proof that both hold the job's
// secret key. Pure: it turns bytes read into bytes to send and a verdict,
// and knows no socket, so that tests and the fuzzer can feed it anything.
//
// Note [Authenticating a connection]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A job is the set of processes that hold its secret key (256 random bits:
// HVDMX_SECRET_KEY, made by hvdmxrun, or by rank 0 at init and sent over
// MPI). Anyone on the network can open a connection to a rank's listening
// port, so nothing a connection says is believed, and nothing is allocated
// for it by a size it sends, until it has proved that it holds the key.
// The lower rank of a pair connects (C); the higher accepts (A):
//   1. C -> A  hello (kHelloBytes): magic and version, the communicator's
//      id and generation, C's rank, A's rank, and a fresh 32-byte nonce Nc.
//   2. A checks every field against what it expects (the id and generation
//      of its own communicator, itself as the target, a lower rank that has
//      not connected yet); anything else is dropped. A -> C  a fresh nonce
//      Na and MAC_A = HMAC-SHA256(key, "A" | transcript), where the
//      transcript is Nc | Na | id | generation | C's rank | A's rank.
//   3. C compares MAC_A with its own computation in constant time: a
//      mismatch means A holds another key, and C fails naming A. C -> A
//      MAC_C = HMAC-SHA256(key, "C" | transcript).
//   4. A compares MAC_C: from then on the connection is C's.
// A connector whose check in step 3 fails sends, in place of MAC_C, a fixed
// refusal (Refusal()) and closes, so that A, too, learns that the keys
// differ rather than only that C went away. A believes that only from the
// address the claimed rank listens on: from anywhere else, as any failure
// of a stranger, it just drops the connection.
// Both nonces are fresh, so a recorded handshake replayed later proves
// nothing; the id and generation bind it to one communicator, the ranks to
// one pair, and the two labels keep one side's MAC from serving as the
// other's. Every message has a fixed size, so a peer cannot make a rank
// allocate or wait for more. The bytes that follow are not encrypted (as in
// NCCL and Gloo): the key keeps strangers out of a job, not eavesdroppers.
#ifndef HVDMX_TCP_HANDSHAKE_H_
#define HVDMX_TCP_HANDSHAKE_H_

#include <cstddef>
#include <cstdint>
#include <string>

namespace hvdmx {

// What a communicator's connections prove: the job's key and which
// communicator they belong to.
struct TcpIdentity {
  std::string key;          // the job's secret key, kSecretKeyBytes
  std::string comm_id;      // kCommIdBytes, the same on every rank of the comm
  uint32_t generation = 0;  // bumped each time a job's comms are rebuilt
};

constexpr size_t kCommIdBytes = 16;
constexpr size_t kNonceBytes = 32;

class Handshake {
 public:
  enum class Role { kConnector, kAcceptor };
  enum class State { kRunning, kDone, kRejected };

  static constexpr size_t kHelloBytes = 8 + kCommIdBytes + 4 + 4 + 4 + kNonceBytes;
  static constexpr size_t kChallengeBytes = kNonceBytes + 32;
  static constexpr size_t kProofBytes = 32;

  // Rank `self` of `size` connecting to `peer`.
  static Handshake Connector(const TcpIdentity& identity, int self, int size, int peer);
  // Rank `self` accepting a connection from a rank below it.
  static Handshake Acceptor(const TcpIdentity& identity, int self);

  // Bytes to send now, and how many of them went. In state kDone the
  // connection is the peer's once what output() still holds is sent; a
  // connector rejected for a wrong key holds its refusal there.
  const std::string& output() const { return output_; }
  void Sent(size_t bytes) { output_.erase(0, bytes); }
  // How many bytes it reads next: 0 while it has nothing to read.
  size_t want() const;
  // Takes bytes read (at most want()).
  void Feed(const char* data, size_t bytes);

  State state() const { return state_; }
  // The rank at the other end: given (connector), or claimed by the hello
  // (acceptor; -1 before it).
  int peer() const { return peer_; }
  // Rejected because the peer's proof did not verify: it holds another key
  // (as opposed to bytes that are not our protocol at all).
  bool wrong_key() const { return wrong_key_; }
  const std::string& why() const { return why_; }
  // What a connector sends in place of its proof when the acceptor's proof
  // did not verify (kProofBytes).
  static const std::string& Refusal();

 private:
  enum class Step { kHello, kChallenge, kProof, kFinished };
  Handshake(const TcpIdentity& identity, Role role, int self, int peer);
  std::string Transcript() const;
  void Reject(const std::string& why, bool wrong_key);
  void OnHello();
  void OnChallenge();
  void OnProof();

  TcpIdentity identity_;
  Role role_;
  int self_;
  int peer_;
  Step step_;
  State state_ = State::kRunning;
  bool wrong_key_ = false;
  std::string connector_nonce_;
  std::string acceptor_nonce_;
  std::string input_;   // the message being read
  std::string output_;  // what is left to send
  std::string why_;
};

}  // namespace hvdmx

#endif  // HVDMX_TCP_HANDSHAKE_H_
