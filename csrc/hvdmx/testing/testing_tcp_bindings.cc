// Entry points for tests/test_tcp_comm.py and tests/test_tcp_handshake.py:
// TcpComm (comm/tcp_comm.h) with threads as ranks in one process, over real
// sockets on the loopback interface, at any size; its failures made on
// purpose; strangers at its listening ports; and the handshake
// (comm/tcp_handshake.h) on its own, for tests and the fuzzer.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "algorithms/adasum.h"
#include "algorithms/exchange_allreduce.h"
#include "base/crypto.h"
#include "bench/threads.h"
#include "comm/tcp_comm.h"
#include "comm/tcp_handshake.h"
#include "testing/testing_bindings.h"

namespace py = pybind11;

namespace hvdmx {
namespace {

// The key every test comm holds unless a test gives another.
std::string TestKey() { return std::string(kSecretKeyBytes, 'k'); }

std::unique_ptr<TcpComm> MakeComm(int rank, int n, ThreadExchange* exchange, TcpOptions options) {
  if (options.key.empty()) options.key = TestKey();
  if (options.iface.empty()) options.iface = "lo";
  return std::make_unique<TcpComm>(
      rank, n, options, [=](const std::string& mine) { return (*exchange)(rank, mine); });
}

// Every collective of the Comm interface, from every root, on n ranks
// (RecordCollectives); bit-ands go rank to rank up to
// `direct_bit_and_ranks` ranks, by recursive doubling beyond. Per rank: what it
// got, and the connections it made.
std::vector<py::dict> TestingTcpCollectives(int n, int direct_bit_and_ranks, int64_t count,
                                            int64_t segment_bytes) {
  ThreadExchange exchange(n);
  TcpOptions options;
  options.direct_bit_and_ranks = direct_bit_and_ranks;
  options.give_up_seconds = 60;
  py::gil_scoped_release release;
  return OnThreads(n, [&](int r, py::dict* result) {
    std::unique_ptr<TcpComm> comm = MakeComm(r, n, &exchange, options);
    RecordCollectives(*comm, count, segment_bytes, result);
    const int connections = comm->connections();
    py::gil_scoped_acquire gil;
    (*result)["connections"] = connections;
  });
}

// n thread ranks whose comms link only with their negotiation peers
// (P2PComm::NegotiationPeers) run what a negotiation round runs: a gather
// of "from r" to rank 0, a string broadcast from it, and a bit-and in which
// rank r clears bit r. Per rank: the ranks it linked with, what it got.
std::vector<py::dict> TestingTcpNegotiation(int n, int direct_bit_and_ranks) {
  ThreadExchange exchange(n);
  TcpOptions options;
  options.direct_bit_and_ranks = direct_bit_and_ranks;
  options.give_up_seconds = 60;
  py::gil_scoped_release release;
  return OnThreads(n, [&](int r, py::dict* result) {
    TcpOptions mine = options;
    mine.peers = P2PComm::NegotiationPeers(r, n, direct_bit_and_ranks);
    std::unique_ptr<TcpComm> comm = MakeComm(r, n, &exchange, mine);
    const std::vector<std::string> gathered = comm->Gather("from " + std::to_string(r), 0);
    std::string s = r == 0 ? "from rank 0" : "";
    comm->BcastString(&s, 0);
    uint64_t word = ~(uint64_t{1} << r);
    comm->StartBitAnd(&word, 1);
    while (!comm->TestBitAnd()) comm->AwaitArrival(1000000);
    const std::vector<int> linked = comm->linked();
    py::gil_scoped_acquire gil;
    (*result)["linked"] = linked;
    (*result)["gathered"] = gathered;
    (*result)["string"] = s;
    (*result)["and"] = word;
  });
}

// RecordCollectives (bit-ands by doubling) and RecordDataCollectives on n
// thread ranks whose comms link only with P2PComm::DataPeers and, given
// host keys, the hierarchical Adasum's pairs: the data comm of a job over
// TCP. Per rank: the ranks it linked with, what it got.
std::vector<py::dict> TestingTcpDataCollectives(int n, const std::vector<int64_t>& matrix,
                                                int64_t count,
                                                const std::vector<std::string>& host_keys) {
  if (static_cast<int>(matrix.size()) != n * n) throw py::value_error("matrix is not n x n");
  ThreadExchange exchange(n);
  TcpOptions options;
  options.direct_bit_and_ranks = 1;
  options.give_up_seconds = 60;
  py::gil_scoped_release release;
  return OnThreads(n, [&](int r, py::dict* result) {
    TcpOptions mine = options;
    mine.peers = P2PComm::DataPeers(r, n,
                                    host_keys.empty()
                                        ? std::vector<int>()
                                        : AdasumHierarchicalPeers(HostMap::FromKeys(host_keys), r));
    std::unique_ptr<TcpComm> comm = MakeComm(r, n, &exchange, mine);
    RecordCollectives(*comm, count, 64, result);
    RecordDataCollectives(*comm, matrix, count, host_keys, result);
    const std::vector<int> linked = comm->linked();
    py::gil_scoped_acquire gil;
    (*result)["linked"] = linked;
  });
}

// A gather to rank 0 over 3 thread ranks: rank 1 sends at once, rank 0
// gathers after `delay` seconds and rank 2 sends after 3 * `delay`, so that
// rank 0's wait finds bytes at its first poll, and waits for more later. Returns what rank 0's idle
// function (Comm::set_idle) was called with, in order.
std::vector<int64_t> TestingTcpGatherIdleCalls(double delay) {
  constexpr int n = 3;
  ThreadExchange exchange(n);
  TcpOptions options;
  options.give_up_seconds = 60;
  std::vector<int64_t> calls;
  std::vector<py::dict> results;
  {
    py::gil_scoped_release release;
    results = OnThreads(n, [&](int r, py::dict*) {
      std::unique_ptr<TcpComm> comm = MakeComm(r, n, &exchange, options);
      if (r == 0) {
        comm->set_idle([&calls](int64_t i) {
          calls.push_back(i);
          std::this_thread::sleep_for(std::chrono::microseconds(100));
          return true;
        });
      }
      std::this_thread::sleep_for(std::chrono::duration<double>(delay * (r == 2 ? 3 : 1 - r)));
      comm->Gather("from " + std::to_string(r), 0);
    });
  }
  for (const py::dict& result : results) {
    const std::string error = py::str(result["error"]);
    if (!error.empty()) throw std::runtime_error(error);
  }
  return calls;
}

// Rank `from` of n thread ranks linked by P2PComm::DataPeers sends a byte
// to rank `to` (not among them); then every rank sends a byte around the
// ring, so that the comms stay up until the others are done. Returns the
// error rank `from`'s send raised, "" if none.
std::string TestingTcpUnlinked(int n, int from, int to) {
  ThreadExchange exchange(n);
  TcpOptions options;
  options.give_up_seconds = 30;
  std::string error;
  std::vector<py::dict> results;
  py::gil_scoped_release release;
  results = OnThreads(n, [&](int r, py::dict*) {
    TcpOptions mine = options;
    mine.peers = P2PComm::DataPeers(r, n);
    std::unique_ptr<TcpComm> comm = MakeComm(r, n, &exchange, mine);
    char byte = 'x', got = 0;
    if (r == from) {
      try {
        comm->Wait(comm->ISend(&byte, 1, to));
      } catch (const UnlinkedPeerError& e) {
        error = e.what();
      }
    }
    const Comm::Request in = comm->IRecv(&got, 1, (r + n - 1) % n);
    comm->Wait(comm->ISend(&byte, 1, (r + 1) % n));
    comm->Wait(in);
  });
  py::gil_scoped_acquire gil;  // held until `results` is gone
  for (const py::dict& result : results) {
    const std::string other = py::str(result["error"]);
    if (!other.empty()) throw std::runtime_error(other);
  }
  return error;
}

// A peer that goes away: with `how` = "close", rank n-1 destroys its comm
// (as its process's end would) while the others wait for its part of a
// bit-and; with "silent", it stays but sends nothing for 3 s while the
// others wait for a message from it, with a give-up time of 0.5 s. Per
// rank: the error its wait raised ("" for rank n-1).
std::vector<py::dict> TestingTcpPeerGone(int n, const std::string& how) {
  ThreadExchange exchange(n);
  TcpOptions options;
  options.give_up_seconds = how == "silent" ? 0.5 : 0;
  py::gil_scoped_release release;
  return OnThreads(n, [&](int r, py::dict*) {
    std::unique_ptr<TcpComm> comm = MakeComm(r, n, &exchange, options);
    // Connect every pair first, so that what fails is the wait below.
    uint64_t word = ~uint64_t{0};
    comm->StartBitAnd(&word, 1);
    while (!comm->TestBitAnd()) comm->AwaitArrival(1000000);
    if (r == n - 1) {
      if (how == "close") {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        comm.reset();
      } else {
        std::this_thread::sleep_for(std::chrono::seconds(3));
      }
      return;
    }
    char byte = 0;
    comm->Wait(comm->IRecv(&byte, 1, n - 1));
  });
}

// Rank 1 of two reports `finding` (TcpComm::ReportStop) while rank 0 waits
// in a receive from it: of `bytes` bytes, or of any size up to 8 bytes when
// `bytes` < 0. Rank 1 then waits until rank 0's comm closes. Per rank: the
// error its wait raised ("" for rank 1).
std::vector<py::dict> TestingTcpReport(const std::string& finding, int64_t bytes) {
  ThreadExchange exchange(2);
  TcpOptions options;
  options.give_up_seconds = 20;
  py::gil_scoped_release release;
  return OnThreads(2, [&](int r, py::dict*) {
    std::unique_ptr<TcpComm> comm = MakeComm(r, 2, &exchange, options);
    uint64_t word = ~uint64_t{0};
    comm->StartBitAnd(&word, 1);
    while (!comm->TestBitAnd()) comm->AwaitArrival(1000000);
    if (r == 1) {
      comm->ReportStop(finding);
      char byte = 0;
      try {
        comm->Wait(comm->IRecv(&byte, 1, 0));
      } catch (const PeerGone&) {
      }
      return;
    }
    std::string any;
    std::vector<char> buf(static_cast<size_t>(std::max<int64_t>(bytes, 1)));
    comm->Wait(bytes >= 0 ? comm->IRecv(buf.data(), bytes, 1) : comm->IRecvAny(&any, 1, 8));
  });
}

// What a fake rank 1 offers as the comm's id in the address exchange (only
// rank 0's is used, but every entry must be well formed).
std::string PeerCommId() { return std::string(2 * kCommIdBytes, '0'); }

// Rank 0 of a comm of two whose rank 1 is `address` ("ip:port host", a
// listener the test made): the first send makes the connection. Returns the
// error it raised, "" if none.
std::string TestingTcpConnectTo(const std::string& address) {
  py::gil_scoped_release release;
  try {
    TcpOptions options;
    options.key = TestKey();
    options.iface = "lo";
    TcpComm comm(0, 2, options, [&](const std::string& mine) {
      return std::vector<std::string>{mine, address + " 1 " + PeerCommId()};
    });
    char byte = 0;
    comm.Wait(comm.ISend(&byte, 1, 1));
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// A job of n thread ranks whose listening ports strangers reach first:
// once every rank has listened and the addresses are known, `strangers`
// (a Python callable) is called with them ("ip:port host id" per rank)
// and may connect to the ports, send what it likes and keep the
// connections open; then the ranks make their links and run a bit-and and
// an allreduce. keys[r], where given, is rank r's secret key. Per rank:
// its error ("" if none), the sum it got, the connections it dropped, and
// the seconds from the end of the exchange to the allreduce's end.
std::vector<py::dict> TestingTcpStrangers(int n, const std::vector<py::bytes>& keys,
                                          py::function strangers, double give_up_seconds) {
  std::vector<std::string> key_bytes;
  for (const py::bytes& k : keys) key_bytes.push_back(k);
  std::chrono::steady_clock::time_point exchanged;
  ThreadExchange exchange(n, [&](const std::vector<std::string>& all) {
    py::gil_scoped_acquire gil;
    strangers(all);
    exchanged = std::chrono::steady_clock::now();
  });
  py::gil_scoped_release release;
  return OnThreads(n, [&](int r, py::dict* result) {
    TcpOptions options;
    options.give_up_seconds = give_up_seconds;
    if (r < static_cast<int>(key_bytes.size())) options.key = key_bytes[r];
    std::unique_ptr<TcpComm> comm;
    int dropped = 0;
    std::vector<float> sum(5);
    for (int i = 0; i < 5; ++i) sum[i] = float(r * 10 + i);
    comm = MakeComm(r, n, &exchange, options);
    dropped = comm->dropped_connections();
    uint64_t word = ~uint64_t{0};
    comm->StartBitAnd(&word, 1);
    while (!comm->TestBitAnd()) comm->AwaitArrival(1000000);
    std::vector<char> scratch;
    ExchangeAllreduce(*comm, sum.data(), 5, DataType::kFloat32, ReduceOp::kSum, &scratch);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - exchanged).count();
    py::gil_scoped_acquire gil;
    (*result)["sum"] = sum;
    (*result)["dropped"] = dropped;
    (*result)["seconds"] = seconds;
  });
}

// Rank 0 of a pair whose rank 1 is played by the test at `listener`
// ("ip:port"): it links (the test answers the handshake with the test key,
// TestKey: 32 bytes of 'k') and then waits for rank 1's part of `what`:
// "recv" (a message of exactly `bytes`), "gather" (a message of any size,
// to rank 0) or "bit_and" (one word). Returns the error it raised, "" if
// none.
std::string TestingTcpLyingPeer(const std::string& listener, const std::string& what,
                                int64_t bytes) {
  py::gil_scoped_release release;
  try {
    TcpOptions options;
    options.key = TestKey();
    options.iface = "lo";
    options.give_up_seconds = 10;
    TcpComm comm(0, 2, options, [&](const std::string& mine) {
      return std::vector<std::string>{mine, listener + " lying-peer 1 " + PeerCommId()};
    });
    if (what == "recv") {
      std::vector<char> buf(static_cast<size_t>(std::max<int64_t>(bytes, 1)));
      comm.Wait(comm.IRecv(buf.data(), bytes, 1));
    } else if (what == "gather") {
      comm.Gather("", 0);
    } else {
      uint64_t word = ~uint64_t{0};
      comm.StartBitAnd(&word, 1);
      while (!comm.TestBitAnd()) comm.AwaitArrival(1000000);
    }
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

void DefineTestingTcpBindings(py::module_& m) {
  py::class_<Handshake>(m, "Handshake")
      .def_static(
          "connector",
          [](const py::bytes& key, const py::bytes& comm_id, uint32_t generation, int self,
             int size, int peer) {
            return Handshake::Connector(TcpIdentity{key, comm_id, generation}, self, size, peer);
          },
          py::arg("key"), py::arg("comm_id"), py::arg("generation"), py::arg("self"),
          py::arg("size"), py::arg("peer"))
      .def_static(
          "acceptor",
          [](const py::bytes& key, const py::bytes& comm_id, uint32_t generation, int self) {
            return Handshake::Acceptor(TcpIdentity{key, comm_id, generation}, self);
          },
          py::arg("key"), py::arg("comm_id"), py::arg("generation"), py::arg("self"))
      .def("output", [](const Handshake& h) { return py::bytes(h.output()); })
      .def("sent", &Handshake::Sent)
      .def("want", &Handshake::want)
      .def("feed",
           [](Handshake& h, const py::bytes& data) {
             const std::string bytes = data;
             h.Feed(bytes.data(), bytes.size());
           })
      .def("state",
           [](const Handshake& h) {
             switch (h.state()) {
               case Handshake::State::kRunning: return "running";
               case Handshake::State::kDone: return "done";
               case Handshake::State::kRejected: return "rejected";
             }
             return "?";
           })
      .def("peer", &Handshake::peer)
      .def("wrong_key", &Handshake::wrong_key)
      .def("why", &Handshake::why);
  m.attr("handshake_hello_bytes") = Handshake::kHelloBytes;
  m.attr("handshake_challenge_bytes") = Handshake::kChallengeBytes;
  m.def("tcp_strangers", &TestingTcpStrangers, py::arg("n"), py::arg("keys"), py::arg("strangers"),
        py::arg("give_up_seconds") = 30.0);
  m.def("tcp_lying_peer", &TestingTcpLyingPeer, py::arg("listener"), py::arg("what"),
        py::arg("bytes") = 0);
  m.attr("tcp_test_key") = py::bytes(TestKey());
  m.def("tcp_collectives", &TestingTcpCollectives, py::arg("n"),
        py::arg("direct_bit_and_ranks") = 16, py::arg("count") = 100,
        py::arg("segment_bytes") = 64);
  m.def("tcp_peer_gone", &TestingTcpPeerGone, py::arg("n"), py::arg("how"));
  m.def("tcp_report", &TestingTcpReport, py::arg("finding"), py::arg("bytes"));
  m.def("tcp_data_collectives", &TestingTcpDataCollectives, py::arg("n"), py::arg("matrix"),
        py::arg("count"), py::arg("host_keys"));
  m.def("tcp_unlinked", &TestingTcpUnlinked, py::arg("n"), py::arg("from_rank"),
        py::arg("to_rank"));
  m.def("tcp_gather_idle_calls", &TestingTcpGatherIdleCalls, py::arg("delay"));
  m.def("tcp_negotiation", &TestingTcpNegotiation, py::arg("n"), py::arg("direct_bit_and_ranks"));
  m.def("tcp_connect_to", &TestingTcpConnectTo, py::arg("address"));
}

}  // namespace hvdmx
