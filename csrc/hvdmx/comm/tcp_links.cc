// TcpComm's links (comm/tcp_comm.h): listening, the address exchange, and
// making one authenticated connection per pair of ranks while the comm is
// built: every connect and every handshake at once, driven by one poll(2)
// loop, each with a deadline of its own, so that a silent or lying client
// of the listening port costs a descriptor for a short while and delays no
// one. The messages themselves and the waits are in tcp_comm.cc.
#include <errno.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <stdexcept>
#include <thread>

#include "base/crypto.h"
#include "base/logging.h"
#include "comm/tcp_address.h"
#include "comm/tcp_comm.h"
#include "comm/tcp_internal.h"

namespace hvdmx {
namespace {

using tcp_internal::Clock;
using tcp_internal::Errno;
using tcp_internal::MicrosSince;

// How long a rank waits for its peers' connections when no give-up time is set.
constexpr double kLinkSeconds = 300;
// How long a rank tries to connect to a peer and hear its challenge: the
// peer listens from before the address exchange, so a connect that has not
// been answered by then will not be.
constexpr int64_t kConnectMicros = 10 * 1000 * 1000;
// Connections to the listening port still proving themselves, at most; past
// it, the oldest is dropped (a real peer proves itself in a round trip).
constexpr size_t kMaxStrangers = 64;
// How often the loop looks at the clock when no socket is ready.
constexpr int kSliceMillis = 50;

// One connection being made.
struct Attempt {
  Socket socket;
  Handshake handshake;
  bool outgoing = false;
  bool connecting = false;  // outgoing: connect(2) not yet answered
  Clock::time_point deadline;
  short revents = 0;
};

}  // namespace

TcpComm::TcpComm(int rank, int size, const TcpOptions& options, const Exchange& exchange)
    : P2PComm(options.direct_bit_and_ranks),
      rank_(rank),
      size_(size),
      options_(options),
      peers_(size) {
  if (options_.key.size() != kSecretKeyBytes) {
    throw std::runtime_error("hvdmx: the TCP transport needs the job's secret key (" +
                             std::to_string(kSecretKeyBytes) + " bytes), got " +
                             std::to_string(options_.key.size()) + " bytes");
  }
  const std::string ip = ChooseAddress(options_.iface);
  sockaddr_in addr{};
  if (!ParseAddress(ip + ":1", &addr)) {
    throw std::runtime_error("hvdmx: cannot listen for peers on '" + ip + "': not an IPv4 address");
  }
  addr.sin_port = 0;
  try {
    listener_ = Socket::Stream();
    listener_.Listen(addr, SOMAXCONN);
    address_ = FormatAddress(listener_.LocalAddress());
  } catch (const SystemError& e) {
    throw std::runtime_error("hvdmx: cannot listen for peers on " + ip + ": " + e.what() +
                             "; choose the interface with HVDMX_TCP_IFACE, or set "
                             "HVDMX_TRANSPORT=mpi");
  }
  // Every rank offers an id for the comm (rank 0's is taken), and says
  // whether it links with every other rank: the algorithms choose by
  // LinksEveryPair, so every rank must give the same answer.
  const bool links_all =
      options_.peers.empty() ||
      static_cast<int>(std::set<int>(options_.peers.begin(), options_.peers.end()).size()) ==
          size_ - 1;
  const std::vector<std::string> entries =
      exchange(address_ + " " + HostName() + " " + (links_all ? "1" : "0") + " " +
               ToHex(RandomBytes(kCommIdBytes)));
  HVDMX_CHECK(static_cast<int>(entries.size()) == size_, "address exchange size");
  for (int j = 0; j < size_; ++j) {
    std::string id;
    bool links = false;
    addresses_.push_back(ParseAddressEntry(j, entries[static_cast<size_t>(j)], &links, &id));
    links_every_pair_ = links_every_pair_ && links;
    if (j == 0) identity_.comm_id = id;
  }
  identity_.key = options_.key;
  identity_.generation = options_.generation;
  if (options_.link_delay_seconds > 0) {
    std::this_thread::sleep_for(std::chrono::duration<double>(options_.link_delay_seconds));
  }
  Link();
  listener_.Close();
  last_moved_ = Clock::now();
}

std::string TcpComm::ParseAddressEntry(int peer, const std::string& entry, bool* links_all,
                                       std::string* comm_id) {
  // "ip:port hostname 0|1 id": four fields, each checked, as every byte a
  // peer sends is input (the exchange may cross a rendezvous on the network).
  std::vector<std::string> fields;
  for (size_t at = 0; at <= entry.size() && fields.size() <= 4;) {
    const size_t space = std::min(entry.find(' ', at), entry.size());
    fields.push_back(entry.substr(at, space - at));
    at = space + 1;
  }
  sockaddr_in addr{};
  const bool ok = fields.size() == 4 && ParseAddress(fields[0], &addr) && !fields[1].empty() &&
                  (fields[2] == "0" || fields[2] == "1") && FromHex(fields[3], comm_id) &&
                  comm_id->size() == kCommIdBytes;
  if (!ok) {
    const std::string shown = entry.size() > 200 ? entry.substr(0, 200) + "..." : entry;
    throw PeerProtocolError(peer, "hvdmx: rank " + std::to_string(peer) +
                                      " sent the address exchange '" + shown +
                                      "' where 'ip:port hostname 0|1 id' was expected, which "
                                      "the protocol does not allow: the ranks may run different "
                                      "versions of hvdmx");
  }
  *links_all = fields[2] == "1";
  return fields[0] + " " + fields[1];
}

TcpComm::~TcpComm() = default;

int TcpComm::connections() const {
  int n = 0;
  for (const Peer& p : peers_) n += p.socket.valid();
  return n;
}

std::vector<int> TcpComm::linked() const {
  std::vector<int> out;
  for (int peer = 0; peer < size_; ++peer) {
    if (peers_[peer].socket.valid()) out.push_back(peer);
  }
  return out;
}

void TcpComm::Link() {
  const Clock::time_point start = Clock::now();
  const double limit = options_.give_up_seconds > 0 ? options_.give_up_seconds : kLinkSeconds;
  const auto handshake_time = std::chrono::microseconds(
      static_cast<int64_t>(std::max(0.001, options_.handshake_seconds) * 1e6));
  std::vector<Attempt> attempts;
  std::vector<Clock::time_point> retry_at(size_, Clock::time_point::max());
  std::set<std::string> dropped_from;
  std::vector<bool> wanted(size_, options_.peers.empty());
  for (int peer : options_.peers) {
    HVDMX_CHECK(peer >= 0 && peer < size_ && peer != rank_,
                "a TCP link to rank " + std::to_string(peer) + " of " + std::to_string(size_));
    wanted[peer] = true;
  }
  wanted[rank_] = false;
  int missing = static_cast<int>(std::count(wanted.begin(), wanted.end(), true));

  // Two ranks that hold different keys are not of one job.
  auto fail_key = [&](int peer, const std::string& what) {
    throw PeerGone(peer, "hvdmx: the connection to " + Describe(peer) + " " + what +
                             ": the two ranks do not hold the same secret key, so they are not "
                             "of one job. Start every rank with the same HVDMX_SECRET_KEY, or "
                             "with none (hvdmxrun, or rank 0 under mpiexec, then makes one "
                             "for all); see docs/running.md");
  };
  auto drop = [&](Attempt& a, const std::string& why) {
    ++dropped_;
    dropped_from.insert(IpOf(a.socket.remote()));
    HVDMX_LOG(kDebug) << "tcp: rank " << rank_ << " dropped a connection from " << a.socket.remote()
                      << ": " << why;
  };
  // A connect that failed: refused means the peer is gone (it listens from
  // before the exchange); anything else may pass with another try.
  auto failed_connect = [&](int peer, int err) {
    if (err == ECONNREFUSED) Fail(peer, "could not be made: " + Errno(err));
    if (MicrosSince(start) >= kConnectMicros) {
      Fail(peer, "could not be made within " + std::to_string(kConnectMicros / 1000000) +
                     " s: " + Errno(err));
    }
    retry_at[peer] = Clock::now() + std::chrono::milliseconds(20);
  };
  auto connect = [&](int peer) {
    retry_at[peer] = Clock::time_point::max();
    sockaddr_in to{};
    const std::string& entry = addresses_[peer];
    HVDMX_CHECK(ParseAddress(entry.substr(0, entry.find(' ')), &to), "a peer's address " + entry);
    Attempt a{Socket::Stream(), Handshake::Connector(identity_, rank_, size_, peer), true};
    const int err = a.socket.StartConnect(to);
    if (err != 0 && err != EINPROGRESS) return failed_connect(peer, err);
    a.connecting = err != 0;
    attempts.push_back(std::move(a));
  };
  for (int peer = rank_ + 1; peer < size_; ++peer) {
    if (wanted[peer]) connect(peer);
  }

  // Moves one attempt on; true when it is over (linked or dropped).
  auto advance = [&](Attempt& a) -> bool {
    Handshake& h = a.handshake;
    if (a.connecting) {
      if (a.revents == 0) {
        if (MicrosSince(start) >= kConnectMicros) failed_connect(h.peer(), ETIMEDOUT);
        return false;
      }
      const int err = a.socket.ConnectError();
      if (err != 0) {
        failed_connect(h.peer(), err);
        return true;
      }
      a.connecting = false;
    }
    auto send = [&] {
      while (!h.output().empty()) {
        const ssize_t n = a.socket.SendSome(h.output().data(), h.output().size());
        if (n == 0) break;
        h.Sent(static_cast<size_t>(n));
      }
    };
    bool closed = false;
    send();
    while (h.state() == Handshake::State::kRunning && h.want() > 0) {
      char buf[Handshake::kHelloBytes];
      const ssize_t n = a.socket.RecvSome(buf, std::min(sizeof(buf), h.want()));
      if (n == 0) break;
      if (n < 0) {
        closed = true;
        break;
      }
      h.Feed(buf, static_cast<size_t>(n));
      if (!a.outgoing && h.peer() >= 0 && peers_[h.peer()].socket.valid()) {
        drop(a, "it claims rank " + std::to_string(h.peer()) + ", which is linked already");
        return true;
      }
      if (!a.outgoing && h.peer() >= 0 && !wanted[h.peer()]) {
        drop(a,
             "it claims rank " + std::to_string(h.peer()) + ", which this rank does not link with");
        return true;
      }
    }
    send();  // what the bytes just read called for (a challenge, a proof)
    const int peer = h.peer();
    const bool from_peer_host = peer >= 0 && IpOf(a.socket.remote()) == IpOf(addresses_[peer]);
    if (h.state() == Handshake::State::kRejected) {
      if (a.outgoing) {
        if (h.wrong_key()) {
          try {
            send();  // the refusal, so that the peer learns why (best effort)
          } catch (const SystemError&) {
          }
          fail_key(peer, "was answered with a proof of another key");
        }
        Fail(peer, "answered with bytes that are not an hvdmx handshake (" + h.why() + ")");
      }
      if (h.wrong_key() && from_peer_host) {
        fail_key(peer, "was made from that rank's host, and " + h.why());
      }
      drop(a, h.why());
      return true;
    }
    if (closed) {
      if (a.outgoing) {
        // The acceptor dropped it (too many strangers at once): try again.
        failed_connect(peer, ECONNRESET);
        return true;
      }
      drop(a, "it closed during the handshake");
      return true;
    }
    if (h.state() == Handshake::State::kDone && h.output().empty()) {
      a.socket.SetNoDelay();
      // The kernel's checks for a peer that stopped answering (Note
      // [Waiting for the network] in tcp_comm.h).
      a.socket.SetKeepAlive(10, 5, 3);
      a.socket.SetUserTimeout(30 * 1000);
      peers_[peer].socket = std::move(a.socket);
      --missing;
      return true;
    }
    if (a.outgoing) {
      if (MicrosSince(start) >= kConnectMicros) {
        Fail(peer, "was not answered within " + std::to_string(kConnectMicros / 1000000) +
                       " s: that rank's process may be stuck, or another program listens on "
                       "its port");
      }
    } else if (Clock::now() >= a.deadline) {
      drop(a, "it did not prove the job's key in time");
      return true;
    }
    return false;
  };

  std::vector<pollfd> fds;
  while (missing > 0) {
    if (MicrosSince(start) > static_cast<int64_t>(limit * 1e6)) {
      int first = 0;
      std::string who;
      for (int peer = 0; peer < size_; ++peer) {
        if (!wanted[peer] || peers_[peer].socket.valid()) continue;
        if (who.empty()) first = peer;
        who += (who.empty() ? "" : ", ") + Describe(peer);
      }
      Fail(first, "was not made within " + std::to_string(static_cast<int>(limit)) +
                      " s (this rank waited for " + who + " to connect" +
                      (dropped_ > 0 ? "; it dropped " + std::to_string(dropped_) +
                                          " connections that did not prove the job's key"
                                    : std::string()) +
                      ")");
    }
    const Clock::time_point now = Clock::now();
    for (int peer = rank_ + 1; peer < size_; ++peer) {
      if (retry_at[peer] <= now) connect(peer);
    }
    fds.clear();
    fds.push_back({listener_.fd(), POLLIN, 0});
    for (const Attempt& a : attempts) {
      const bool writing = a.connecting || !a.handshake.output().empty();
      fds.push_back({a.socket.fd(), static_cast<short>(writing ? POLLOUT : POLLIN), 0});
    }
    PollSockets(&fds, kSliceMillis);
    for (size_t i = 0; i < attempts.size(); ++i) attempts[i].revents = fds[i + 1].revents;
    for (;;) {
      Socket s = listener_.Accept();
      if (!s.valid()) break;
      size_t strangers = 0;
      for (const Attempt& a : attempts) strangers += !a.outgoing;
      if (strangers >= kMaxStrangers) {
        auto oldest = std::find_if(attempts.begin(), attempts.end(),
                                   [](const Attempt& a) { return !a.outgoing; });
        drop(*oldest, "too many connections were proving themselves at once");
        attempts.erase(oldest);
      }
      attempts.push_back(Attempt{std::move(s), Handshake::Acceptor(identity_, rank_), false, false,
                                 Clock::now() + handshake_time, POLLIN});
    }
    for (size_t i = 0; i < attempts.size();) {
      bool over = false;
      try {
        over = advance(attempts[i]);
      } catch (const SystemError& e) {
        Attempt& a = attempts[i];
        if (a.outgoing) {
          failed_connect(a.handshake.peer(), e.error());
        } else {
          drop(a, e.what());
        }
        over = true;
      }
      if (over) {
        attempts.erase(attempts.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        ++i;
      }
    }
  }
  // Strangers still proving themselves are dropped with the port.
  for (Attempt& a : attempts) {
    if (!a.outgoing) drop(a, "the links were made before it proved the job's key");
  }
  if (dropped_ > 0) {
    std::string from;
    for (const std::string& ip : dropped_from) from += (from.empty() ? "" : ", ") + ip;
    HVDMX_LOG(kWarning) << "hvdmx: rank " << rank_ << " dropped " << dropped_
                        << " connections to its TCP port that did not prove the job's key "
                           "(from "
                        << from
                        << "); the job goes on. See docs/running.md, 'Who can join "
                           "a job'";
  }
}

}  // namespace hvdmx
