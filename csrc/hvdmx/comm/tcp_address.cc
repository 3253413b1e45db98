#include "comm/tcp_address.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <unistd.h>

#include <cstring>
#include <stdexcept>

namespace hvdmx {
namespace {

bool IsLoopback(const in_addr& a) { return (ntohl(a.s_addr) >> 24) == 127; }

std::string Ip(const in_addr& a) {
  char text[INET_ADDRSTRLEN];
  inet_ntop(AF_INET, &a, text, sizeof(text));
  return text;
}

}  // namespace

std::string HostName() {
  char name[256] = {0};
  gethostname(name, sizeof(name) - 1);
  return name;
}

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

bool ParseAddress(const std::string& ip_port, sockaddr_in* out) {
  const size_t colon = ip_port.find(':');
  if (colon == std::string::npos) return false;
  const std::string port = ip_port.substr(colon + 1);
  if (port.empty() || port.size() > 5 ||
      port.find_first_not_of("0123456789") != std::string::npos) {
    return false;
  }
  const int value = std::stoi(port);
  if (value <= 0 || value > 65535) return false;
  std::memset(out, 0, sizeof(*out));
  out->sin_family = AF_INET;
  out->sin_port = htons(static_cast<uint16_t>(value));
  return inet_pton(AF_INET, ip_port.substr(0, colon).c_str(), &out->sin_addr) == 1;
}

std::string IpOf(const std::string& ip_port) { return ip_port.substr(0, ip_port.find(':')); }

}  // namespace hvdmx
