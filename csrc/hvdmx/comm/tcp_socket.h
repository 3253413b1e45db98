// A TCP socket that owns its descriptor, with one method per option, and the
// error a failed system call on it raises. What TcpComm's links
// (tcp_links.cc) and messages (tcp_comm.cc) are built from; nothing here
// knows ranks or the protocol.
#ifndef HVDMX_TCP_SOCKET_H_
#define HVDMX_TCP_SOCKET_H_

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace hvdmx {

// A system call that failed: which one, its errno, and the address it was
// talking to ("" where there is none).
class SystemError : public std::runtime_error {
 public:
  SystemError(const std::string& syscall, int error, const std::string& remote);
  const std::string& syscall() const { return syscall_; }
  int error() const { return error_; }
  const std::string& remote() const { return remote_; }

 private:
  std::string syscall_;
  int error_;
  std::string remote_;
};

// "ip:port" of an IPv4 socket address.
std::string FormatAddress(const sockaddr_in& address);

class Socket {
 public:
  Socket() = default;
  // Takes ownership of `fd`; `remote` names the other end in errors.
  Socket(int fd, std::string remote) : fd_(fd), remote_(std::move(remote)) {}
  ~Socket() { Close(); }
  Socket(Socket&& other) noexcept { *this = std::move(other); }
  Socket& operator=(Socket&& other) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  // A new IPv4 stream socket, non-blocking and closed on exec.
  static Socket Stream();

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  const std::string& remote() const { return remote_; }
  void Close();

  // Options. Each throws SystemError naming the option.
  void SetNoDelay();
  // Probes after `idle` s of silence, `interval` s apart; gone after `count`.
  void SetKeepAlive(int idle, int interval, int count);
  // Unacknowledged data for this long fails the connection.
  void SetUserTimeout(int millis);

  // Listening: bind to `address` (port 0: any), listen, and say where.
  void Listen(const sockaddr_in& address, int backlog);
  sockaddr_in LocalAddress() const;
  // One connection waiting to be accepted, non-blocking itself; an invalid
  // socket when none waits (or it vanished before accept).
  Socket Accept();

  // Starts a connect: 0 when it is made, EINPROGRESS while under way, else
  // the errno it failed with. ConnectError then says how it ended (SO_ERROR).
  int StartConnect(const sockaddr_in& address);
  int ConnectError() const;

  // Moves what the kernel takes, or has, now, without blocking: the bytes
  // moved, 0 when it would block; a receive returns -1 when the other end
  // closed the stream. Any other failure throws SystemError.
  ssize_t SendSome(const void* data, size_t bytes);
  ssize_t RecvSome(void* data, size_t bytes);
  ssize_t SendMessage(const msghdr* message);
  ssize_t RecvMessage(msghdr* message);

 private:
  [[noreturn]] void Throw(const std::string& syscall, int error) const;

  int fd_ = -1;
  std::string remote_;
};

// poll(2) that retries nothing: returns how many descriptors are ready (0
// on timeout or an interrupt); throws SystemError on a real failure.
int PollSockets(std::vector<pollfd>* fds, int timeout_millis);

}  // namespace hvdmx

#endif  // HVDMX_TCP_SOCKET_H_
