// What tcp_comm.cc and tcp_links.cc share (TcpComm's two halves); not
// part of the Comm interface.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>

namespace hvdmx {
namespace tcp_internal {

using Clock = std::chrono::steady_clock;

inline std::string Errno(int err) { return std::string(std::strerror(err)); }

inline int64_t MicrosSince(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t).count();
}

}  // namespace tcp_internal
}  // namespace hvdmx
