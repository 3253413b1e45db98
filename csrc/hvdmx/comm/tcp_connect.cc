// TcpComm's connections (comm/tcp_comm.h): the address a rank listens on,
// the address exchange, and making one connection per pair of ranks on its
// first message, the lower rank connecting. The messages themselves and the
// waits are in tcp_comm.cc.
#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "comm/tcp_comm.h"
#include "comm/tcp_internal.h"

namespace hvdmx {
namespace {

using tcp_internal::Clock;
using tcp_internal::Errno;
using tcp_internal::MicrosSince;

constexpr uint32_t kHelloMagic = 0x58445648;  // "HVDX"
// How long a rank waits for a peer's connection when no give-up time is set.
constexpr double kConnectSeconds = 300;
// How long a rank tries to connect to a peer, which listens from before the
// address exchange: a handshake that has not completed by then will not.
constexpr int64_t kConnectMicros = 10 * 1000 * 1000;

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

}  // namespace hvdmx
