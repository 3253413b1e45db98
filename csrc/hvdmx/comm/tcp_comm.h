// Comm over TCP sockets of our own: the negotiation and the collectives'
// bytes of a job that spans hosts travel here instead of through MPI, and
// in a job started without MPI (hvdmxrun --no-mpi) every message that
// shared memory does not carry, so that every wait blocks in poll(2) and
// wakes when a byte arrives (Note [Waiting for the network]). Which ranks
// this serves, and with which links, is the job's choice (Note [The job's
// comms] in job/comm_wiring.h). The one exchange of addresses that builds
// this comm goes through the job's Group (comm/group.h): an MPI
// communicator, or the launcher's rendezvous. The files: tcp_address
// (where a rank listens), tcp_socket (a descriptor and its options),
// tcp_handshake (the proof of the job's key), tcp_links.cc (making every
// connection), tcp_comm.cc (frames, queues and the waits). The broadcast,
// gather and bit-and are P2PComm's, written once over these messages
// (comm/p2p_collectives.cc).
//
// Note [Waiting for the network]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// MPI moves bytes only while some thread is inside an MPI call: a rank
// waiting for a nonblocking MPI operation must call MPI_Test again and
// again. Our background thread used to poll that way, sleeping between
// tests (up to 1 ms, so that an idle job costs no CPU); across hosts each
// step of a negotiation round or of a collective then waited for the
// sleeping side's next test. With four ranks on two cores it was worse:
// spinning ranks took the cores from the ranks they were waiting for, and
// sleeping ranks answered a millisecond late (docs/benchmarks.md, "Many
// hosts"). A TCP socket needs no caller to move bytes: the kernel receives
// them into the socket's buffer on its own, and a thread blocked in poll(2)
// on the socket is woken as they arrive. So every wait here (Wait, and
// AwaitArrival between TestBitAnd calls) tries its sockets without
// blocking, and when nothing moved blocks in poll(2) on the sockets it
// waits for: no spinning, no timer, and no CPU taken from the ranks that
// are working.
//
// Links: one stream connection per pair of ranks that talk (every pair, or
// those TcpOptions::peers names: O(log n) a rank for the negotiation's comm
// and for the collectives' (P2PComm::NegotiationPeers, P2PComm::DataPeers;
// Note [The data comm's links] in comm/p2p_comm.h), so that a rank's
// descriptors, handshakes and keepalive probes do not grow with the job's
// size), all made while the comm is built,
// concurrently (tcp_links.cc): the lower rank connects, the
// higher accepts, and each proves to the other that it holds the job's key
// before anything else is read (Note [Authenticating a connection] in
// comm/tcp_handshake.h). A connection to the listening port that does not
// prove it within a short deadline is dropped without delaying the others;
// once every peer is linked the port closes, so nothing from outside the job
// reaches a running comm. Building the comm is the one step that blocks on
// first contact: bounded by the give-up time (or 300 s without one) for the
// peers to arrive, 10 s for a connect to be answered, and 2 s for a stranger
// to prove itself.
//
// Frames: every message is an 8-byte length followed by its bytes; a pair's
// messages arrive in the order they were sent, which is the order Comm
// promises (as MPI's, for one tag). A receive posted for a known size must
// get exactly that size; a receive of any size takes it from the header, up
// to the limit its caller set. A peer that breaks either rule fails the comm
// with PeerProtocolError naming it and what it sent.
//
// Failure: a connection that closes or fails, or (with give_up_seconds) a
// wait during which no byte moved for that long, throws PeerGone naming the
// peer and its host. TCP keepalive (probes after 10 s of silence, three
// missed 5 s apart) and TCP_USER_TIMEOUT (30 s of unacknowledged data) make
// the kernel report a peer or link that stopped answering even when no
// give-up time is set.
#ifndef HVDMX_TCP_COMM_H_
#define HVDMX_TCP_COMM_H_

#include <sys/socket.h>
#include <sys/uio.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "comm/p2p_comm.h"
#include "comm/tcp_handshake.h"
#include "comm/tcp_socket.h"
#include "config/env_config.h"

namespace hvdmx {

struct TcpOptions {
  // The interface whose IPv4 address this rank listens on and gives its
  // peers (HVDMX_TCP_IFACE). Empty: the address this host's name resolves
  // to when it is not a loopback address, else the first interface that is
  // up, not loopback and has one, else 127.0.0.1 (one host only).
  std::string iface;
  // A wait in which no byte moved for this long throws PeerGone; 0: wait
  // as long as the kernel's keepalive says the peer is there.
  double give_up_seconds = 0;
  // How long a wait tries its sockets without blocking (yielding the CPU
  // between tries) before it blocks in poll(2): a reply often comes within
  // tens of microseconds, sooner than a blocked thread is woken.
  int64_t spin_micros = 0;
  // Up to this many ranks, a bit-and goes from every rank to every other;
  // beyond, by recursive doubling (Note [The bit-and over point-to-point]
  // in comm/p2p_collectives.cc).
  int direct_bit_and_ranks = P2PComm::kDirectBitAndRanks;
  // The ranks to link with (the relation must be symmetric: every rank's
  // list names the ranks whose lists name it); empty: every other rank. A
  // comm that only negotiates links with P2PComm::NegotiationPeers, one
  // that carries the collectives' bytes with P2PComm::DataPeers (Note [The
  // data comm's links] in comm/p2p_comm.h); both are symmetric by
  // construction. A rank that is named by a list it does not name back
  // is refused in the handshake, so an asymmetric relation fails while the
  // comm is built (the rank that wants the link cannot make it), not later.
  std::vector<int> peers;
  // The job's secret key (kSecretKeyBytes), which every connection proves.
  std::string key;
  // Which build of the job's comms this is (Note [Authenticating a connection]).
  uint32_t generation = 0;
  // How long a connection to the listening port has to prove itself.
  double handshake_seconds = 2.0;
  // Tests only: a wait between the address exchange and the links
  // (HVDMX_TESTING_LINK_DELAY_SECONDS).
  double link_delay_seconds = 0;
};

// The options the configuration gives: HVDMX_TCP_IFACE, the stall shutdown
// time as the give-up time (0 when there is none), the spin, and the job's
// secret key.
inline TcpOptions TcpOptionsFor(const Config& config, bool ranks_outnumber_cpus) {
  constexpr int64_t kSpinMicros = 50;
  TcpOptions options;
  options.spin_micros = config.tcp_spin_micros >= 0 ? config.tcp_spin_micros
                        : ranks_outnumber_cpus      ? 0
                                                    : kSpinMicros;
  options.iface = config.tcp_iface;
  options.give_up_seconds = config.stall_shutdown_seconds;
  options.key = config.secret_key;
  options.link_delay_seconds = config.testing_link_delay_seconds;
  return options;
}

class TcpComm : public P2PComm {
 public:
  // Every rank's string, index = rank; collective over the ranks.
  using Exchange = std::function<std::vector<std::string>(const std::string&)>;

  // Collective: listens, exchanges addresses through `exchange`, and links
  // to every other rank (or those options.peers names). Throws std::runtime_error saying why when
  // it cannot listen, PeerGone naming the peer when a link cannot be made (gone, unreachable, or
  // holding another key).
  TcpComm(int rank, int size, const TcpOptions& options, const Exchange& exchange);
  ~TcpComm() override;
  TcpComm(const TcpComm&) = delete;
  TcpComm& operator=(const TcpComm&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  // This rank's address as its peers reach it, "ip:port".
  const std::string& address() const { return address_; }

  Request ISend(const void* buf, int64_t bytes, int peer) override;
  Request IRecv(void* buf, int64_t bytes, int peer) override;
  void Wait(Request request) override;
  Request IRecvAny(std::string* out, int peer, int64_t max_bytes) override;
  bool Test(Request request) override;
  void WaitAll(const std::vector<Request>& requests, Waiting waiting) override;
  // A frame of another size than posted, or over the limit: PeerProtocolError.
  [[noreturn]] void FailProtocol(int peer, const std::string& what) override;
  PeerSender Sender(int peer) const override { return PeerSender{peer, Describe(peer)}; }
  bool NativeAllreduce(void*, int64_t, DataType, ReduceOp) override { return false; }
  bool WakesOnArrival() const override { return true; }
  bool LinksEveryPair() const override { return links_every_pair_; }
  void AwaitArrival(int64_t waited_micros) override;
  // Note [A rank's finding reaches every rank] in negotiation/controller.h:
  // a report frame (the header's top bit set, then at most kMaxReportBytes
  // of text) to every linked rank. A receive that meets one, whatever it
  // was posted for, throws PeerProtocolError saying which rank reports what.
  void ReportStop(const std::string& finding) override;
  static constexpr uint64_t kReportBit = uint64_t{1} << 63;
  static constexpr int64_t kMaxReportBytes = 4096;

  // Connections made (for tests), and connections to the listening port
  // that were dropped because they did not prove the job's key.
  int connections() const;
  // The ranks this rank is linked with, ascending.
  std::vector<int> linked() const;
  int dropped_connections() const { return dropped_; }

 private:
  struct Op {
    bool send = false;
    bool done = false;
    char* buf = nullptr;
    int64_t bytes = 0;
    int64_t max_bytes = 0;       // a receive of any size: the most it takes
    int64_t moved = 0;           // header and payload bytes moved so far
    uint64_t header = 0;         // the length on the wire
    std::string* any = nullptr;  // a receive of any size lands here
  };
  struct Peer {
    Socket socket;
    std::deque<Request> sends;
    std::deque<Request> recvs;
  };

  Request Post(Op op, int peer);
  // Makes every link (tcp_links.cc).
  void Link();
  // Moves what the sockets take or give without blocking; true if a byte moved.
  bool ProgressAll();
  // Points msg at what is left of op (header, then body) in iov[0..1];
  // returns its bytes.
  static size_t Remaining(Op& op, msghdr* msg, iovec* iov);
  bool ProgressSends(int peer);
  bool ProgressRecvs(int peer);
  // Blocks until a socket with pending work is ready, or `micros` pass.
  void PollPending(int64_t micros);
  // Progresses and blocks until done() holds; see give_up_seconds.
  void WaitUntil(const std::function<bool()>& done, const char* what, bool use_idle);
  void Free(Request request);
  // WaitUntil the request is done, then Free it.
  void Finish(Request request, const char* what, bool use_idle);
  [[noreturn]] void Fail(int peer, const std::string& what);
  // `op`, a receive from `peer`, met a report frame: reads its text (what
  // the receive took of it already, then the rest, for at most a second)
  // and throws PeerProtocolError saying that `peer` reports it.
  [[noreturn]] void FailReported(int peer, const Op& op);
  [[noreturn]] void FailOnError(int peer, int err, const char* doing);
  std::string Describe(int peer) const;

  int rank_ = 0;
  int size_ = 1;
  TcpOptions options_;
  Socket listener_;  // open only while the links are made
  // Peer `peer`'s entry of the address exchange, checked field by field:
  // returns "ip:port hostname" and sets whether it links every pair and the
  // comm id it offers; throws PeerProtocolError naming the rank otherwise.
  static std::string ParseAddressEntry(int peer, const std::string& entry, bool* links_all,
                                       std::string* comm_id);

  std::string address_;
  TcpIdentity identity_;
  int dropped_ = 0;
  bool links_every_pair_ = true;
  std::vector<std::string> addresses_;  // "ip:port hostname", index = rank
  std::string report_;                  // what ReportStop sends, kept until sent
  std::vector<Peer> peers_;
  std::vector<int> pending_;  // peers with queued operations, unordered
  std::vector<Op> ops_;
  std::vector<Request> free_ops_;
  std::chrono::steady_clock::time_point last_moved_;
};

}  // namespace hvdmx

#endif  // HVDMX_TCP_COMM_H_
