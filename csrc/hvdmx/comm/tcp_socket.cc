#include "comm/tcp_socket.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/tcp.h>
#include <unistd.h>

#include <cstring>

namespace hvdmx {

SystemError::SystemError(const std::string& syscall, int error, const std::string& remote)
    : std::runtime_error(syscall + (remote.empty() ? "" : " (" + remote + ")") + ": " +
                         std::strerror(error)),
      syscall_(syscall),
      error_(error),
      remote_(remote) {}

std::string FormatAddress(const sockaddr_in& address) {
  char text[INET_ADDRSTRLEN] = {0};
  inet_ntop(AF_INET, &address.sin_addr, text, sizeof(text));
  return std::string(text) + ":" + std::to_string(ntohs(address.sin_port));
}

Socket& Socket::operator=(Socket&& other) noexcept {
  if (this != &other) {
    Close();
    fd_ = other.fd_;
    remote_ = std::move(other.remote_);
    other.fd_ = -1;
  }
  return *this;
}

Socket Socket::Stream() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) throw SystemError("socket", errno, "");
  return Socket(fd, "");
}

void Socket::Close() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

void Socket::Throw(const std::string& syscall, int error) const {
  throw SystemError(syscall, error, remote_);
}

namespace {

void SetInt(int fd, int level, int name, int value, const char* what, const std::string& remote) {
  if (setsockopt(fd, level, name, &value, sizeof(value)) != 0) {
    throw SystemError(std::string("setsockopt(") + what + ")", errno, remote);
  }
}

}  // namespace

void Socket::SetNoDelay() { SetInt(fd_, IPPROTO_TCP, TCP_NODELAY, 1, "TCP_NODELAY", remote_); }

void Socket::SetKeepAlive(int idle, int interval, int count) {
  SetInt(fd_, SOL_SOCKET, SO_KEEPALIVE, 1, "SO_KEEPALIVE", remote_);
  SetInt(fd_, IPPROTO_TCP, TCP_KEEPIDLE, idle, "TCP_KEEPIDLE", remote_);
  SetInt(fd_, IPPROTO_TCP, TCP_KEEPINTVL, interval, "TCP_KEEPINTVL", remote_);
  SetInt(fd_, IPPROTO_TCP, TCP_KEEPCNT, count, "TCP_KEEPCNT", remote_);
}

void Socket::SetUserTimeout(int millis) {
  SetInt(fd_, IPPROTO_TCP, TCP_USER_TIMEOUT, millis, "TCP_USER_TIMEOUT", remote_);
}

void Socket::Listen(const sockaddr_in& address, int backlog) {
  remote_ = "listening on " + FormatAddress(address);
  if (bind(fd_, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
    Throw("bind", errno);
  }
  if (listen(fd_, backlog) != 0) Throw("listen", errno);
}

sockaddr_in Socket::LocalAddress() const {
  sockaddr_in address{};
  socklen_t len = sizeof(address);
  if (getsockname(fd_, reinterpret_cast<sockaddr*>(&address), &len) != 0) {
    Throw("getsockname", errno);
  }
  return address;
}

Socket Socket::Accept() {
  sockaddr_in from{};
  socklen_t len = sizeof(from);
  const int fd =
      accept4(fd_, reinterpret_cast<sockaddr*>(&from), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (fd >= 0) return Socket(fd, FormatAddress(from));
  // Nothing waits, or the connection was reset before we took it: neither
  // is the listener's failure. Running out of descriptors is.
  if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
    Throw("accept4", errno);
  }
  return Socket();
}

int Socket::StartConnect(const sockaddr_in& address) {
  remote_ = FormatAddress(address);
  if (connect(fd_, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) == 0) return 0;
  return errno;
}

int Socket::ConnectError() const {
  int err = 0;
  socklen_t len = sizeof(err);
  if (getsockopt(fd_, SOL_SOCKET, SO_ERROR, &err, &len) != 0) return errno;
  return err;
}

namespace {

bool WouldBlock(int err) { return err == EAGAIN || err == EWOULDBLOCK || err == EINTR; }

}  // namespace

ssize_t Socket::SendSome(const void* data, size_t bytes) {
  const ssize_t n = send(fd_, data, bytes, MSG_DONTWAIT | MSG_NOSIGNAL);
  if (n >= 0) return n;
  if (WouldBlock(errno)) return 0;
  Throw("send", errno);
}

ssize_t Socket::RecvSome(void* data, size_t bytes) {
  if (bytes == 0) return 0;
  const ssize_t n = recv(fd_, data, bytes, MSG_DONTWAIT);
  if (n > 0) return n;
  if (n == 0) return -1;
  if (WouldBlock(errno)) return 0;
  Throw("recv", errno);
}

ssize_t Socket::SendMessage(const msghdr* message) {
  const ssize_t n = sendmsg(fd_, message, MSG_DONTWAIT | MSG_NOSIGNAL);
  if (n >= 0) return n;
  if (WouldBlock(errno)) return 0;
  Throw("sendmsg", errno);
}

ssize_t Socket::RecvMessage(msghdr* message) {
  const ssize_t n = recvmsg(fd_, message, MSG_DONTWAIT);
  if (n > 0) return n;
  if (n == 0) return -1;
  if (WouldBlock(errno)) return 0;
  Throw("recvmsg", errno);
}

int PollSockets(std::vector<pollfd>* fds, int timeout_millis) {
  const int n = poll(fds->data(), fds->size(), timeout_millis);
  if (n >= 0) return n;
  if (errno == EINTR) return 0;
  throw SystemError("poll", errno, "");
}

}  // namespace hvdmx
