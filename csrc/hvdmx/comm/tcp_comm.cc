#include "comm/tcp_comm.h"

#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "comm/tcp_internal.h"

namespace hvdmx {
namespace {

using tcp_internal::Clock;
using tcp_internal::Errno;
using tcp_internal::MicrosSince;

constexpr int kHeaderBytes = 8;
// How long a blocked wait sleeps in poll(2) before it looks at the clock
// (give-up time, idle function); arrivals wake it at once.
constexpr int64_t kPollSliceMicros = 100 * 1000;

}  // namespace

std::string TcpComm::Describe(int peer) const {
  const std::string& entry = addresses_[peer];
  const size_t space = entry.find(' ');
  return "rank " + std::to_string(peer) + " (host " + entry.substr(space + 1) + ", " +
         entry.substr(0, space) + ")";
}

void TcpComm::Fail(int peer, const std::string& what) {
  throw PeerGone(peer, "hvdmx: the connection to " + Describe(peer) + " " + what +
                           "; that rank's process may have ended, or its host or link be down. "
                           "hvdmx has stopped on this rank: end the job and look at the other "
                           "ranks' output (see docs/errors.md)");
}

void TcpComm::FailProtocol(int peer, const std::string& what) {
  throw PeerProtocolError(peer, "hvdmx: " + Describe(peer) + " sent " + what +
                                    ", which the protocol does not allow: the ranks may run "
                                    "different versions of hvdmx or different collectives. hvdmx "
                                    "has stopped on this rank: end the job and look at the other "
                                    "ranks' output (see docs/errors.md)");
}

void TcpComm::FailReported(int peer, const Op& op) {
  const uint64_t length = op.header & ~kReportBit;
  if (length > static_cast<uint64_t>(kMaxReportBytes)) {
    FailProtocol(peer, "a report of " + std::to_string(length) + " bytes where at most " +
                           std::to_string(kMaxReportBytes) + " may follow");
  }
  std::string text(static_cast<size_t>(length), '\0');
  // A receive of known size read the report's first bytes into its buffer.
  size_t have = 0;
  if (op.bytes > 0 && op.moved > kHeaderBytes) {
    have = std::min<size_t>(text.size(), static_cast<size_t>(op.moved - kHeaderBytes));
    std::memcpy(&text[0], op.buf, have);
  }
  Socket& socket = peers_[peer].socket;
  const Clock::time_point start = Clock::now();
  while (have < text.size() && MicrosSince(start) < 1000 * 1000) {
    ssize_t n = 0;
    try {
      n = socket.RecvSome(&text[have], text.size() - have);
    } catch (const SystemError&) {
      break;
    }
    if (n < 0) break;  // closed: what came is what there is
    if (n == 0) {
      std::vector<pollfd> fds{{socket.fd(), POLLIN, 0}};
      PollSockets(&fds, 10);
    }
    have += static_cast<size_t>(n);
  }
  text.resize(have);
  // The peer's text, shown as text: no control characters of its choosing.
  for (char& c : text) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  }
  throw PeerProtocolError(peer, "hvdmx: " + Describe(peer) + " reports that " + text);
}

void TcpComm::ReportStop(const std::string& finding) {
  constexpr char kPrefix[] = "hvdmx: ";
  report_ = finding.compare(0, sizeof(kPrefix) - 1, kPrefix) == 0
                ? finding.substr(sizeof(kPrefix) - 1)
                : finding;
  if (report_.size() > static_cast<size_t>(kMaxReportBytes)) report_.resize(kMaxReportBytes);
  std::vector<int> to;
  std::vector<Request> sends;
  for (int peer : linked()) {
    Op op;
    op.send = true;
    op.buf = &report_[0];
    op.bytes = static_cast<int64_t>(report_.size());
    op.header = kReportBit | static_cast<uint64_t>(report_.size());
    sends.push_back(Post(op, peer));
    to.push_back(peer);
  }
  // Each goes after what this rank still sends that peer; a peer that does
  // not read, or is gone, is left behind after a second.
  const Clock::time_point start = Clock::now();
  std::vector<bool> done(to.size(), false);
  for (;;) {
    bool all = true;
    for (size_t k = 0; k < to.size(); ++k) {
      if (done[k]) continue;
      try {
        ProgressSends(to[k]);
        done[k] = ops_[sends[k]].done;
      } catch (const PeerGone&) {
        done[k] = true;
      }
      all = all && done[k];
    }
    if (all || MicrosSince(start) >= 1000 * 1000) break;
    usleep(1000);
  }
}

void TcpComm::FailOnError(int peer, int err, const char* doing) {
  // A reset (or a write after the peer's close) is how a peer whose process
  // ended without closing cleanly shows.
  if (err == ECONNRESET || err == EPIPE) Fail(peer, "was closed by that rank (" + Errno(err) + ")");
  Fail(peer, std::string("failed while ") + doing + ": " + Errno(err));
}

TcpComm::Request TcpComm::Post(Op op, int peer) {
  HVDMX_CHECK(peer >= 0 && peer < size_ && peer != rank_, "bad peer " + std::to_string(peer));
  Peer& p = peers_[peer];
  if (!p.socket.valid()) {
    std::string linked;
    for (int j : this->linked()) linked += (linked.empty() ? "" : ", ") + std::to_string(j);
    throw UnlinkedPeerError(
        peer, "hvdmx internal error: rank " + std::to_string(rank_) + " of " +
                  std::to_string(size_) + (op.send ? " sent to" : " posted a receive from") +
                  " rank " + std::to_string(peer) +
                  ", with which it has no TCP link (it links with ranks " + linked +
                  "; Note [The data comm's links] in comm/p2p_comm.h). This is a bug in hvdmx; "
                  "please report it with this message");
  }
  Request r;
  if (free_ops_.empty()) {
    r = static_cast<Request>(ops_.size());
    ops_.push_back(op);
  } else {
    r = free_ops_.back();
    free_ops_.pop_back();
    ops_[r] = op;
  }
  if (p.sends.empty() && p.recvs.empty()) pending_.push_back(peer);
  (op.send ? p.sends : p.recvs).push_back(r);
  return r;
}

TcpComm::Request TcpComm::ISend(const void* buf, int64_t bytes, int peer) {
  Op op;
  op.send = true;
  op.buf = static_cast<char*>(const_cast<void*>(buf));
  op.bytes = bytes;
  op.header = static_cast<uint64_t>(bytes);
  Request r = Post(op, peer);
  CountSent(bytes);
  // Most messages fit the socket's buffer: send at once, sparing a poll.
  ProgressSends(peer);
  return r;
}

TcpComm::Request TcpComm::IRecv(void* buf, int64_t bytes, int peer) {
  Op op;
  op.buf = static_cast<char*>(buf);
  op.bytes = bytes;
  return Post(op, peer);
}

TcpComm::Request TcpComm::IRecvAny(std::string* out, int peer, int64_t max_bytes) {
  Op op;
  op.any = out;
  op.bytes = -1;
  op.max_bytes = max_bytes;
  return Post(op, peer);
}

size_t TcpComm::Remaining(Op& op, msghdr* msg, iovec* iov) {
  size_t n_iov = 0, bytes = 0;
  if (op.moved < kHeaderBytes) {
    iov[n_iov++] = {reinterpret_cast<char*>(&op.header) + op.moved,
                    static_cast<size_t>(kHeaderBytes - op.moved)};
  }
  const int64_t body = std::max<int64_t>(0, op.moved - kHeaderBytes);
  if (op.bytes > body) iov[n_iov++] = {op.buf + body, static_cast<size_t>(op.bytes - body)};
  for (size_t k = 0; k < n_iov; ++k) bytes += iov[k].iov_len;
  msg->msg_iov = iov;
  msg->msg_iovlen = n_iov;
  return bytes;
}

bool TcpComm::ProgressSends(int peer) {
  Peer& p = peers_[peer];
  bool moved = false;
  while (!p.sends.empty()) {
    Op& op = ops_[p.sends.front()];
    msghdr msg{};
    iovec iov[2];
    const size_t want = Remaining(op, &msg, iov);
    ssize_t n = 0;
    try {
      n = want == 0 ? 0 : p.socket.SendMessage(&msg);
    } catch (const SystemError& e) {
      FailOnError(peer, e.error(), "sending");
    }
    if (want > 0 && n == 0) break;
    moved = moved || n > 0;
    op.moved += n;
    if (op.moved < kHeaderBytes + op.bytes) break;
    op.done = true;
    p.sends.pop_front();
  }
  return moved;
}

bool TcpComm::ProgressRecvs(int peer) {
  Peer& p = peers_[peer];
  bool moved = false;
  while (!p.recvs.empty()) {
    Op& op = ops_[p.recvs.front()];
    // A receive of any size (bytes < 0) learns its size from the header
    // first; one of known size reads header and body at once.
    msghdr msg{};
    iovec iov[2];
    const size_t want = Remaining(op, &msg, iov);
    ssize_t n = 0;
    if (want > 0) {
      try {
        n = p.socket.RecvMessage(&msg);
      } catch (const SystemError& e) {
        FailOnError(peer, e.error(), "receiving");
      }
      if (n < 0) Fail(peer, "was closed by that rank");
      if (n == 0) break;
      moved = true;
    }
    const bool header_arrived = op.moved < kHeaderBytes && op.moved + n >= kHeaderBytes;
    op.moved += n;
    if (header_arrived && (op.header & kReportBit) != 0) FailReported(peer, op);
    if (header_arrived && op.bytes < 0) {
      if (op.header > static_cast<uint64_t>(op.max_bytes)) {
        FailProtocol(peer, "a message of " + std::to_string(op.header) + " bytes where at most " +
                               std::to_string(op.max_bytes) + " were expected");
      }
      op.any->resize(op.header);
      op.buf = &(*op.any)[0];
      op.bytes = static_cast<int64_t>(op.header);
    } else if (header_arrived && op.header != static_cast<uint64_t>(op.bytes)) {
      FailProtocol(peer, "a message of " + std::to_string(op.header) + " bytes where " +
                             std::to_string(op.bytes) + " were expected");
    }
    if (op.moved < kHeaderBytes || op.moved < kHeaderBytes + op.bytes) {
      if (static_cast<size_t>(n) < want) break;  // the socket has no more for now
      continue;
    }
    op.done = true;
    CountReceived(op.bytes);
    p.recvs.pop_front();
  }
  return moved;
}

bool TcpComm::ProgressAll() {
  bool moved = false;
  for (size_t i = 0; i < pending_.size();) {
    const int peer = pending_[i];
    moved |= ProgressSends(peer);
    moved |= ProgressRecvs(peer);
    const Peer& p = peers_[peer];
    if (p.sends.empty() && p.recvs.empty()) {
      pending_[i] = pending_.back();
      pending_.pop_back();
    } else {
      ++i;
    }
  }
  if (moved) last_moved_ = Clock::now();
  return moved;
}

void TcpComm::PollPending(int64_t micros) {
  std::vector<pollfd> fds;
  fds.reserve(pending_.size());
  for (int peer : pending_) {
    const Peer& p = peers_[peer];
    short events = 0;
    if (!p.sends.empty()) events |= POLLOUT;
    if (!p.recvs.empty()) events |= POLLIN;
    fds.push_back({p.socket.fd(), events, 0});
  }
  const int ms = static_cast<int>((micros + 999) / 1000);
  if (fds.empty()) {
    usleep(static_cast<useconds_t>(micros));
    return;
  }
  PollSockets(&fds, ms);
}

void TcpComm::AwaitArrival(int64_t waited_micros) {
  if (ProgressAll()) return;
  if (waited_micros < options_.spin_micros) {
    sched_yield();
    return;
  }
  PollPending(kPollSliceMicros);
}

void TcpComm::WaitUntil(const std::function<bool()>& done, const char* what, bool use_idle) {
  const Clock::time_point start = Clock::now();
  last_moved_ = start;
  // Calls of idle_ so far: its argument (Comm::set_idle), which the runtime
  // reads as "a wait begins" when 0, so polls that moved bytes do not count.
  int64_t idled = 0;
  for (;;) {
    if (done()) return;
    if (ProgressAll()) continue;
    if (done()) return;
    if (use_idle && idle_) {
      if (!idle_(idled++)) throw CommAbandoned();
    } else if (MicrosSince(start) >= options_.spin_micros) {
      PollPending(kPollSliceMicros);
    } else {
      sched_yield();
    }
    if (options_.give_up_seconds > 0 &&
        MicrosSince(last_moved_) > static_cast<int64_t>(options_.give_up_seconds * 1e6)) {
      std::ostringstream peers;
      for (size_t k = 0; k < pending_.size(); ++k) {
        peers << (k ? ", " : "") << Describe(pending_[k]);
      }
      const int first = pending_.empty() ? -1 : pending_[0];
      throw PeerGone(first, "hvdmx: no bytes have moved between this rank and " + peers.str() +
                                " for " + std::to_string(options_.give_up_seconds) +
                                " s (HVDMX_STALL_SHUTDOWN_TIME_SECONDS) while this rank waited "
                                "in " +
                                what +
                                "; a host or its link may be down, or a rank stuck. hvdmx has "
                                "stopped on this rank: end the job and look at the other ranks' "
                                "output (see docs/errors.md)");
    }
  }
}

void TcpComm::Free(Request request) {
  ops_[request] = Op();
  free_ops_.push_back(request);
}

void TcpComm::Wait(Request request) { Finish(request, "a collective's transfer", false); }

bool TcpComm::Test(Request request) {
  if (!ops_[request].done) ProgressAll();
  return ops_[request].done;
}

void TcpComm::WaitAll(const std::vector<Request>& requests, Waiting waiting) {
  const bool negotiation = waiting == Waiting::kNegotiation;
  WaitUntil(
      [&] {
        for (Request r : requests) {
          if (!ops_[r].done) return false;
        }
        return true;
      },
      negotiation ? "negotiation" : "a collective's transfer", negotiation);
  for (Request r : requests) Free(r);
}

void TcpComm::Finish(Request request, const char* what, bool use_idle) {
  WaitUntil([&] { return ops_[request].done; }, what, use_idle);
  Free(request);
}

}  // namespace hvdmx
