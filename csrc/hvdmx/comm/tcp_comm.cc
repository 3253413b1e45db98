#include "comm/tcp_comm.h"

#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <sstream>
#include <stdexcept>

namespace hvdmx {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kHelloMagic = 0x58445648;  // "HVDX"
constexpr int kHeaderBytes = 8;
// How long a blocked wait sleeps in poll(2) before it looks at the clock
// (give-up time, idle function); arrivals wake it at once.
constexpr int64_t kPollSliceMicros = 100 * 1000;
// How long a rank waits for a peer's connection when no give-up time is set.
constexpr double kConnectSeconds = 300;
// How long a rank tries to connect to a peer, which listens from before the
// address exchange: a handshake that has not completed by then will not.
constexpr int64_t kConnectMicros = 10 * 1000 * 1000;

std::string Errno(int err) { return std::string(std::strerror(err)); }

int64_t MicrosSince(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t).count();
}

bool IsLoopback(const in_addr& a) { return (ntohl(a.s_addr) >> 24) == 127; }

std::string Ip(const in_addr& a) {
  char text[INET_ADDRSTRLEN];
  inet_ntop(AF_INET, &a, text, sizeof(text));
  return text;
}

std::string HostName() {
  char name[256] = {0};
  gethostname(name, sizeof(name) - 1);
  return name;
}

// The IPv4 address to listen on; see TcpOptions::iface.
std::string ChooseAddress(const std::string& iface) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) list = nullptr;
  std::string found;
  std::string names;
  for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
    const in_addr a = reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr;
    names += std::string(names.empty() ? "" : ", ") + i->ifa_name + " (" + Ip(a) + ")";
    if (!iface.empty()) {
      if (found.empty() && iface == i->ifa_name) found = Ip(a);
    } else if (found.empty() && (i->ifa_flags & IFF_UP) && !(i->ifa_flags & IFF_LOOPBACK) &&
               !IsLoopback(a)) {
      found = Ip(a);
    }
  }
  if (list != nullptr) freeifaddrs(list);
  if (!iface.empty()) {
    if (found.empty()) {
      throw std::runtime_error("hvdmx: HVDMX_TCP_IFACE=" + iface +
                               " is not an interface with an IPv4 address on this host (" +
                               (names.empty() ? std::string("none has one") : names) +
                               "); set it to one of those, or unset it");
    }
    return found;
  }
  addrinfo hints{};
  hints.ai_family = AF_INET;
  addrinfo* res = nullptr;
  if (getaddrinfo(HostName().c_str(), nullptr, &hints, &res) == 0) {
    for (addrinfo* r = res; r != nullptr; r = r->ai_next) {
      const in_addr a = reinterpret_cast<sockaddr_in*>(r->ai_addr)->sin_addr;
      if (!IsLoopback(a)) {
        found = Ip(a);
        break;
      }
    }
    freeaddrinfo(res);
  }
  return found.empty() ? "127.0.0.1" : found;
}

void SetOption(int fd, int level, int name, int value) {
  setsockopt(fd, level, name, &value, sizeof(value));
}

// Every connection: no Nagle delay on small messages, and the kernel's
// checks for a peer that stopped answering (Note [Waiting for the network]).
void ConfigureConnection(int fd) {
  SetOption(fd, IPPROTO_TCP, TCP_NODELAY, 1);
  SetOption(fd, SOL_SOCKET, SO_KEEPALIVE, 1);
  SetOption(fd, IPPROTO_TCP, TCP_KEEPIDLE, 10);
  SetOption(fd, IPPROTO_TCP, TCP_KEEPINTVL, 5);
  SetOption(fd, IPPROTO_TCP, TCP_KEEPCNT, 3);
  SetOption(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, 30 * 1000);
}

// FNV-1a over the bytes: the comm's token, the same on every rank.
uint64_t Hash(const std::string& bytes) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : bytes) h = (h ^ c) * 1099511628211ULL;
  return h;
}

bool SplitAddress(const std::string& entry, sockaddr_in* out) {
  const size_t colon = entry.find(':');
  if (colon == std::string::npos) return false;
  std::memset(out, 0, sizeof(*out));
  out->sin_family = AF_INET;
  out->sin_port = htons(static_cast<uint16_t>(std::stoi(entry.substr(colon + 1))));
  return inet_pton(AF_INET, entry.substr(0, colon).c_str(), &out->sin_addr) == 1;
}

// Reads or writes exactly `bytes` on a blocking exchange of the hello,
// waiting at most `micros` in all. False on timeout, close or error.
bool Exactly(int fd, char* buf, int64_t bytes, bool write, int64_t micros) {
  const Clock::time_point start = Clock::now();
  int64_t done = 0;
  while (done < bytes) {
    const ssize_t n = write ? send(fd, buf + done, bytes - done, MSG_DONTWAIT | MSG_NOSIGNAL)
                            : recv(fd, buf + done, bytes - done, MSG_DONTWAIT);
    if (n > 0) {
      done += n;
      continue;
    }
    if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return false;
    const int64_t left = micros - MicrosSince(start);
    if (left <= 0) return false;
    pollfd p{fd, static_cast<short>(write ? POLLOUT : POLLIN), 0};
    poll(&p, 1, static_cast<int>(std::min<int64_t>(left / 1000 + 1, 1000)));
  }
  return true;
}

// connect(2) on the non-blocking socket `fd`, waiting at most `micros` for
// the handshake: 0, or the errno it failed with (ETIMEDOUT when the time ran
// out). A blocking connect would wait for the kernel's SYN retries, about
// two minutes, where the peer's host is gone or drops packets.
int ConnectWithin(int fd, const sockaddr_in& addr, int64_t micros) {
  if (connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0) return 0;
  if (errno != EINPROGRESS) return errno;
  pollfd p{fd, POLLOUT, 0};
  if (poll(&p, 1, static_cast<int>(std::max<int64_t>(micros / 1000, 1))) <= 0) return ETIMEDOUT;
  int err = 0;
  socklen_t len = sizeof(err);
  if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) return errno;
  return err;
}

}  // namespace

TcpComm::TcpComm(int rank, int size, const TcpOptions& options, const Exchange& exchange)
    : rank_(rank), size_(size), options_(options), peers_(size) {
  const std::string ip = ChooseAddress(options_.iface);
  listen_fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  inet_pton(AF_INET, ip.c_str(), &addr.sin_addr);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (listen_fd_ < 0 || bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(listen_fd_, std::max(size, 16)) != 0 ||
      getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const int err = errno;
    if (listen_fd_ >= 0) close(listen_fd_);
    throw std::runtime_error("hvdmx: cannot listen for peers on " + ip + ": " + Errno(err) +
                             "; choose the interface with HVDMX_TCP_IFACE, or set "
                             "HVDMX_TRANSPORT=mpi");
  }
  address_ = ip + ":" + std::to_string(ntohs(addr.sin_port));
  addresses_ = exchange(address_ + " " + HostName());
  HVDMX_CHECK(static_cast<int>(addresses_.size()) == size_, "address exchange size");
  std::string all;
  for (const std::string& a : addresses_) all += a + "\n";
  token_ = Hash(all);
  last_moved_ = Clock::now();
}

TcpComm::~TcpComm() {
  for (Peer& p : peers_) {
    if (p.fd >= 0) close(p.fd);
  }
  if (listen_fd_ >= 0) close(listen_fd_);
}

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

void TcpComm::FailOnError(int peer, int err, const char* doing) {
  // A reset (or a write after the peer's close) is how a peer whose process
  // ended without closing cleanly shows.
  if (err == ECONNRESET || err == EPIPE) Fail(peer, "was closed by that rank (" + Errno(err) + ")");
  Fail(peer, std::string("failed while ") + doing + ": " + Errno(err));
}

int TcpComm::connections() const {
  int n = 0;
  for (const Peer& p : peers_) n += p.fd >= 0;
  return n;
}

void TcpComm::Connect(int peer) {
  sockaddr_in addr;
  HVDMX_CHECK(SplitAddress(addresses_[peer], &addr), "bad peer address " + addresses_[peer]);
  const Clock::time_point start = Clock::now();
  int fd = -1;
  for (int attempt = 0;; ++attempt) {
    fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    const int err = ConnectWithin(fd, addr, kConnectMicros - MicrosSince(start));
    if (err == 0) break;
    close(fd);
    // The peer listens from before the exchange, so a refusal means it is
    // gone; a full backlog or a slow link may need another try.
    if (err == ECONNREFUSED) Fail(peer, "could not be made: " + Errno(err));
    if (MicrosSince(start) >= kConnectMicros) {
      Fail(peer, "could not be made within " + std::to_string(kConnectMicros / 1000000) +
                     " s: " + Errno(err));
    }
    usleep(std::min(1000 * (attempt + 1), 100 * 1000));
  }
  char hello[16];
  const uint32_t magic = kHelloMagic;
  const uint32_t me = static_cast<uint32_t>(rank_);
  std::memcpy(hello, &magic, 4);
  std::memcpy(hello + 4, &me, 4);
  std::memcpy(hello + 8, &token_, 8);
  if (!Exactly(fd, hello, sizeof(hello), /*write=*/true, 10 * 1000 * 1000)) {
    close(fd);
    Fail(peer, "failed while it was being made");
  }
  ConfigureConnection(fd);
  peers_[peer].fd = fd;
}

void TcpComm::AcceptUntil(int peer) {
  const double limit = options_.give_up_seconds > 0 ? options_.give_up_seconds : kConnectSeconds;
  const Clock::time_point start = Clock::now();
  while (peers_[peer].fd < 0) {
    const int64_t left = static_cast<int64_t>(limit * 1e6) - MicrosSince(start);
    if (left <= 0) {
      Fail(peer, "was not made within " + std::to_string(static_cast<int>(limit)) +
                     " s (this rank waited for that rank to connect)");
    }
    pollfd p{listen_fd_, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(std::min<int64_t>(left / 1000 + 1, 1000))) <= 0) continue;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    char hello[16];
    uint32_t magic = 0, from = 0;
    uint64_t token = 0;
    if (Exactly(fd, hello, sizeof(hello), /*write=*/false, 10 * 1000 * 1000)) {
      std::memcpy(&magic, hello, 4);
      std::memcpy(&from, hello + 4, 4);
      std::memcpy(&token, hello + 8, 8);
    }
    // Anything else (a port scan, another comm's stray) is dropped.
    // Only lower ranks connect (see Post).
    if (magic != kHelloMagic || token != token_ || static_cast<int>(from) >= rank_ ||
        peers_[from].fd >= 0) {
      close(fd);
      continue;
    }
    ConfigureConnection(fd);
    peers_[from].fd = fd;
  }
}

TcpComm::Request TcpComm::Post(Op op, int peer) {
  HVDMX_CHECK(peer >= 0 && peer < size_ && peer != rank_, "bad peer " + std::to_string(peer));
  Peer& p = peers_[peer];
  if (p.fd < 0) {
    if (rank_ < peer) {
      Connect(peer);
    } else {
      AcceptUntil(peer);
    }
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

TcpComm::Request TcpComm::IRecvAny(std::string* out, int peer) {
  Op op;
  op.any = out;
  op.bytes = -1;
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
    const ssize_t n = want == 0 ? 0 : sendmsg(p.fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
      FailOnError(peer, errno, "sending");
    }
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
      n = recvmsg(p.fd, &msg, MSG_DONTWAIT);
      if (n == 0) Fail(peer, "was closed by that rank");
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
        FailOnError(peer, errno, "receiving");
      }
      moved = true;
    }
    const bool header_arrived = op.moved < kHeaderBytes && op.moved + n >= kHeaderBytes;
    op.moved += n;
    if (header_arrived && op.bytes < 0) {
      HVDMX_CHECK(op.header <= static_cast<uint64_t>(kMaxMessageBytes) * 64,
                  "a message header from " + Describe(peer) + " is not one of ours");
      op.any->resize(op.header);
      op.buf = &(*op.any)[0];
      op.bytes = static_cast<int64_t>(op.header);
    } else if (header_arrived) {
      HVDMX_CHECK(op.header == static_cast<uint64_t>(op.bytes),
                  "a message of " + std::to_string(op.header) + " bytes from " + Describe(peer) +
                      " where " + std::to_string(op.bytes) +
                      " were expected: the ranks are running different collectives");
    }
    if (op.moved < kHeaderBytes || op.moved < kHeaderBytes + op.bytes) {
      if (static_cast<size_t>(n) < want) break;  // the socket has no more for now
      continue;
    }
    op.done = true;
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
    fds.push_back({p.fd, events, 0});
  }
  const int ms = static_cast<int>((micros + 999) / 1000);
  if (fds.empty()) {
    usleep(static_cast<useconds_t>(micros));
    return;
  }
  poll(fds.data(), fds.size(), ms);
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
  for (int64_t i = 0;; ++i) {
    if (done()) return;
    if (ProgressAll()) continue;
    if (done()) return;
    if (use_idle && idle_) {
      if (!idle_(i)) throw CommAbandoned();
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

void TcpComm::Finish(Request request, const char* what, bool use_idle) {
  WaitUntil([&] { return ops_[request].done; }, what, use_idle);
  Free(request);
}

}  // namespace hvdmx
