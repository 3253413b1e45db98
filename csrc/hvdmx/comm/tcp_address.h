// Where a rank listens and how its peers find it: the IPv4 address chosen
// from the host's interfaces (HVDMX_TCP_IFACE), this host's name, and the
// "ip:port host" entries ranks exchange when a TcpComm is built.
#ifndef HVDMX_TCP_ADDRESS_H_
#define HVDMX_TCP_ADDRESS_H_

#include <netinet/in.h>

#include <string>

namespace hvdmx {

// The IPv4 address to listen on; see TcpOptions::iface. Throws
// std::runtime_error naming the interfaces there are when `iface` is not one.
std::string ChooseAddress(const std::string& iface);

std::string HostName();

// "ip:port" into a socket address; false if it is not one.
bool ParseAddress(const std::string& ip_port, sockaddr_in* out);

// The IP of "ip:port" ("" if none).
std::string IpOf(const std::string& ip_port);

}  // namespace hvdmx

#endif  // HVDMX_TCP_ADDRESS_H_
