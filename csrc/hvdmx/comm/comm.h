// What the negotiation and the collectives need from a transport, and
// nothing more, as two interfaces: ControlComm, what a negotiation round
// needs (the bit-and and its payloads, the coordinator's gather and
// broadcast of strings, the waits between polls), and DataComm, what the
// collectives need (point-to-point messages, a broadcast of bytes, the
// transport's own allreduce). A transport that serves both is a Comm:
// MpiComm (mpi_comm.h) runs MPI's own calls; TcpComm (tcp_comm.h) and
// LocalComm (local_comm.h) are P2PComms (p2p_comm.h), whose broadcast,
// gather and bit-and are written once over their point-to-point messages.
// LocalComm runs one rank per thread inside one process so that those, the
// ring and the negotiation round can be tested at any size without MPI.
// The negotiation's comms made of shared memory (ShmControlComm,
// HostTreeComm in shm/) are ControlComms only: they move no tensor's bytes.
//
// Threading: a comm object is used by one thread at a time (the runtime's
// background thread). Every collective-style call must be made by all ranks
// of the communicator in the same order.
//
// First contact: a comm is ready when its constructor returns, so no call
// below waits to reach a peer for the first time. Building one is the step
// that may block on first contact: TcpComm connects to and authenticates
// every peer there, bounded by the give-up time (300 s without one) for
// the peers to arrive and 10 s for a connect to be answered (comm/tcp_comm.h).
#ifndef HVDMX_COMM_H_
#define HVDMX_COMM_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "base/common.h"

namespace hvdmx {

// Thrown by a Gather or BcastString that its comm's idle function gave up on
// (Comm::set_idle).
class CommAbandoned : public std::runtime_error {
 public:
  CommAbandoned() : std::runtime_error("a negotiation exchange was abandoned") {}
};

// Thrown by a wait whose peer will not do its part any more: it stopped,
// died, or cannot be reached (a shared-memory peer that stopped, a TCP
// connection that closed or went silent). The message says which peer and
// what was seen. Note [A peer that stops] in shm/shm_region.h says what
// the runtime does with it.
//
// The transports' messages end with what to do next, from kPeerGoneAdvice
// on; an elastic job, which goes on without the peer, logs the message
// without it (Runtime::StopAfterPeer).
inline constexpr char kPeerGoneAdvice[] = "hvdmx has stopped on this rank";
class PeerGone : public std::runtime_error {
 public:
  PeerGone(int peer, const std::string& what) : std::runtime_error(what), peer_(peer) {}
  // The peer's rank in the communicator (or host) that noticed.
  int peer() const { return peer_; }

 private:
  int peer_;
};

// A peer sent what the protocol does not allow (a message of another size
// than the one posted, a length over the limit, a bit-and shorter than its
// words, a negotiation message that does not parse: Note [Peer input] in
// comm/peer_input.h): the comm cannot go on. The message names the peer and
// what it sent.
class PeerProtocolError : public PeerGone {
 public:
  using PeerGone::PeerGone;
};

struct PeerSender;  // comm/peer_input.h

// A reduction that travels with a bit-and (Note [Small tensors in the
// round] in negotiation/round_reduction.h): each rank starts with a
// partial of its own, and the comm combines partials as the bit-and's
// messages meet, so that every rank ends with the combination of all of
// them, bitwise the same everywhere. The comm knows nothing of what a
// partial holds; the reduction does.
class BitAndReduction {
 public:
  virtual ~BitAndReduction() = default;
  // The combination of two partials over disjoint sets of ranks; wherever
  // the order of operands matters, `low` is the partial of the lower rank
  // of the two that meet, so that both compute the same bytes. Both have
  // passed Check or were combined here from partials that have; `from` is
  // the peer whose partial is one of them, named should one not parse after
  // all (PeerProtocolError, Note [Peer input] in comm/peer_input.h).
  virtual std::string Combine(const std::string& low, const std::string& high,
                              const PeerSender& from) const = 0;
  // Throws PeerProtocolError naming `from` when `partial`, which `from`
  // gave, is not a partial this reduction could have made.
  virtual void Check(const std::string& partial, const PeerSender& from) const = 0;
};

// One rank's side of a combining bit-and: its partial, how to combine, and,
// once TestBitAnd has returned true, the combination of every rank's.
struct BitAndPartial {
  std::string mine;
  const BitAndReduction* reduction = nullptr;
  std::string combined;
  // The most bytes a partial may hold on the wire; a longer one from a
  // peer fails the comm naming it.
  static constexpr int64_t kMaxBytes = 24 * 1024;
  // What a comm checks before it starts: a reduction, and a partial of at
  // most kMaxBytes.
  bool Ready() const {
    return reduction != nullptr && static_cast<int64_t>(mine.size()) <= kMaxBytes;
  }
};

// What a negotiation round needs from a transport (negotiation/controller.h).
class ControlComm {
 public:
  virtual ~ControlComm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Root receives every rank's string (index = rank); others get {}.
  virtual std::vector<std::string> Gather(const std::string& mine, int root) = 0;
  // Root's *data replaces everyone else's.
  virtual void BcastString(std::string* data, int root) = 0;
  // How Gather and BcastString wait for the other ranks (MpiComm and every
  // P2PComm wait without blocking): idle(i) is called between polls, with
  // the number of calls before it in this wait, and when it returns false
  // the call throws CommAbandoned, leaving the comm unusable for them. A
  // peer that stopped in the middle of a negotiation round (a stall
  // shutdown) thus cannot hold this rank forever. Unset: wait as long as
  // it takes.
  virtual void set_idle(std::function<bool(int64_t)> idle) { idle_ = std::move(idle); }

  // How a caller that polls this comm (TestBitAnd) waits between polls;
  // see Note [Waiting for the network] in comm/tcp_comm.h. A comm that can
  // wake on arrival (TcpComm: poll(2) on its sockets) says so, and
  // AwaitArrival, given how long the caller has waited so far, returns
  // when a byte may have arrived (or after a while, so that the caller can
  // look at the clock). The others (MPI moves bytes only inside MPI calls)
  // do not, and their callers poll and sleep on a timer.
  virtual bool WakesOnArrival() const { return false; }
  virtual void AwaitArrival(int64_t waited_micros) { (void)waited_micros; }

  // A bitwise AND over `n` words, split in two so that the caller can wait
  // without spinning: StartBitAnd, then TestBitAnd until it returns true; the
  // result is then in `words`. One may be outstanding at a time.
  virtual void StartBitAnd(uint64_t* words, int n) = 0;
  virtual bool TestBitAnd() = 0;

  // Optional: bytes that travel with a bit-and, so that a negotiation round
  // that gathers to rank 0 after its bit-and needs no exchange of its own.
  // BitAndPayloadCapacity() is the most a payload may hold; 0 (the
  // default): this comm carries none. After TestBitAnd has returned true,
  // rank 0 may read rank j's payload with BitAndPayload(j) until its next
  // StartBitAnd.
  virtual int64_t BitAndPayloadCapacity() const { return 0; }
  virtual void StartBitAndWithPayload(uint64_t* words, int n, const std::string& payload) {
    HVDMX_CHECK(payload.empty(), "this communicator carries no bit-and payload");
    StartBitAnd(words, n);
  }
  virtual std::string BitAndPayload(int rank) const {
    HVDMX_CHECK(false,
                "this communicator carries no bit-and payload (rank " + std::to_string(rank) + ")");
    return std::string();
  }

  // Optional: a partial that is combined with the bit-and's words on the
  // way (BitAndReduction). A comm that cannot carry one (the default)
  // combines nothing: partial->combined comes out empty on every rank, which
  // the caller reads as "nothing was reduced". `partial` must live until
  // TestBitAnd has returned true.
  virtual bool CombinesPartials() const { return false; }
  virtual void StartBitAndCombining(uint64_t* words, int n, const std::string& payload,
                                    BitAndPartial* partial) {
    partial->combined.clear();
    StartBitAndWithPayload(words, n, payload);
  }

  // Optional: tells the ranks this one negotiates with that it has stopped
  // on `finding` (the text of a PeerProtocolError it raised), so that each
  // fails naming the rank that broke the protocol instead of waiting for
  // this one (Note [A rank's finding reaches every rank] in
  // negotiation/controller.h). Best effort and bounded: it waits at most
  // about a second for the bytes to leave. The default (a comm whose peers
  // learn of a stop otherwise, or not at all) does nothing.
  virtual void ReportStop(const std::string& finding) { (void)finding; }

 protected:
  std::function<bool(int64_t)> idle_;
};

// What the collectives need from a transport (algorithms/, runtime/executor.h).
class DataComm {
 public:
  using Request = int64_t;

  virtual ~DataComm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Nonblocking point-to-point of at most kMaxMessageBytes. Every request
  // must be passed to Wait exactly once.
  static constexpr int64_t kMaxMessageBytes = int64_t{1} << 30;
  virtual Request ISend(const void* buf, int64_t bytes, int peer) = 0;
  virtual Request IRecv(void* buf, int64_t bytes, int peer) = 0;
  virtual void Wait(Request request) = 0;

  // Blocking broadcast of any number of bytes from `root`.
  virtual void Bcast(void* buf, int64_t bytes, int root) = 0;

  // Whether this rank can send to and receive from every other rank. A
  // comm that links only with some (TcpComm with TcpOptions::peers, a
  // LocalComm given its links) says no, and the collectives that would talk
  // to every rank route through the ranks it links with instead (Note [The
  // data comm's links] in comm/p2p_comm.h).
  virtual bool LinksEveryPair() const { return true; }

  // The transport's own allreduce, in place (AllreduceAlgo::kNative).
  // Returns false (touching nothing) when it has none for this dtype/op,
  // e.g. float16 in MPI, or none at all (a P2PComm).
  virtual bool NativeAllreduce(void* buf, int64_t count, DataType dtype, ReduceOp op) = 0;
};

// A transport that serves the negotiation and the collectives alike.
class Comm : public ControlComm, public DataComm {
 public:
  int rank() const override = 0;
  int size() const override = 0;
};

// Post the send (receive) of `bytes` to (from) `peer` in messages of at most
// DataComm::kMaxMessageBytes, appending their requests; nothing for 0 bytes.
// Both sides cut the same total the same way, so every message's size is
// known to its receiver.
inline void PostSendPieces(DataComm& comm, const char* buf, int64_t bytes, int peer,
                           std::vector<DataComm::Request>* requests) {
  for (int64_t done = 0; done < bytes; done += DataComm::kMaxMessageBytes) {
    requests->push_back(
        comm.ISend(buf + done, std::min(DataComm::kMaxMessageBytes, bytes - done), peer));
  }
}
inline void PostRecvPieces(DataComm& comm, char* buf, int64_t bytes, int peer,
                           std::vector<DataComm::Request>* requests) {
  for (int64_t done = 0; done < bytes; done += DataComm::kMaxMessageBytes) {
    requests->push_back(
        comm.IRecv(buf + done, std::min(DataComm::kMaxMessageBytes, bytes - done), peer));
  }
}

}  // namespace hvdmx

#endif  // HVDMX_COMM_H_
