// Entry points for tests/test_tcp_comm.py: TcpComm (comm/tcp_comm.h) with
// threads as ranks in one process, over real sockets on the loopback
// interface, at any size; its failures made on purpose.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "algorithms/exchange_allreduce.h"
#include "algorithms/ring.h"
#include "comm/tcp_comm.h"
#include "testing/testing_bindings.h"

namespace py = pybind11;

namespace hvdmx {
namespace {

// The address exchange of n threads: each puts its string and waits for
// every other's.
class ThreadExchange {
 public:
  explicit ThreadExchange(int n) : slots_(n) {}
  std::vector<std::string> operator()(int rank, const std::string& mine) {
    std::unique_lock<std::mutex> lock(mu_);
    slots_[rank] = mine;
    if (++arrived_ == static_cast<int>(slots_.size())) cv_.notify_all();
    cv_.wait(lock, [&] { return arrived_ == static_cast<int>(slots_.size()); });
    return slots_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::string> slots_;
  int arrived_ = 0;
};

std::unique_ptr<TcpComm> MakeComm(int rank, int n, ThreadExchange* exchange,
                                  const TcpOptions& options) {
  return std::make_unique<TcpComm>(
      rank, n, options, [=](const std::string& mine) { return (*exchange)(rank, mine); });
}

// Runs body(rank) on n threads; returns what each returned, or what it threw.
std::vector<py::dict> OnThreads(int n, const std::function<void(int, py::dict*)>& body) {
  std::vector<std::string> errors(n);
  std::vector<py::dict> out;
  {
    py::gil_scoped_acquire gil;
    for (int r = 0; r < n; ++r) out.emplace_back();
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r, &out[r]);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  py::gil_scoped_acquire gil;
  for (int r = 0; r < n; ++r) out[r]["error"] = errors[r];
  return out;
}

// Every collective of the Comm interface, from every root, on n ranks;
// bit-ands go rank to rank up to `direct_bit_and_ranks` ranks, through rank
// 0 beyond. Per rank: what it got.
std::vector<py::dict> TestingTcpCollectives(int n, int direct_bit_and_ranks, int64_t count,
                                            int64_t segment_bytes) {
  ThreadExchange exchange(n);
  TcpOptions options;
  options.direct_bit_and_ranks = direct_bit_and_ranks;
  options.give_up_seconds = 60;
  py::gil_scoped_release release;
  return OnThreads(n, [&](int r, py::dict* result) {
    std::unique_ptr<TcpComm> comm = MakeComm(r, n, &exchange, options);
    // Three bit-ands: rank r clears bit (r + round) of every word.
    std::vector<std::vector<uint64_t>> ands;
    std::vector<std::vector<std::string>> payloads;
    for (int round = 0; round < 3; ++round) {
      std::vector<uint64_t> words(3, ~uint64_t{0});
      for (uint64_t& w : words) w &= ~(uint64_t{1} << ((r + round) % 64));
      comm->StartBitAndWithPayload(
          words.data(), 3,
          "payload of rank " + std::to_string(r) + " round " + std::to_string(round));
      while (!comm->TestBitAnd()) comm->AwaitArrival(1000000);
      ands.push_back(words);
      std::vector<std::string> got;
      if (r == 0) {
        for (int j = 0; j < n; ++j) got.push_back(comm->BitAndPayload(j));
      }
      payloads.push_back(got);
    }
    std::vector<std::vector<std::string>> gathers;
    std::vector<std::string> strings;
    std::vector<std::vector<int>> bcasts;
    for (int root = 0; root < n; ++root) {
      gathers.push_back(comm->Gather(std::string(r, static_cast<char>('a' + root)), root));
      std::string s = r == root ? std::string(root * 1000 + 1, static_cast<char>('A' + root)) : "";
      comm->BcastString(&s, root);
      strings.push_back(s);
      std::vector<int> b(count, r == root ? root + 1 : -1);
      comm->Bcast(b.data(), count * 4, root);
      bcasts.push_back(b);
    }
    std::vector<float> exchanged(count), ringed(count);
    for (int64_t i = 0; i < count; ++i) exchanged[i] = ringed[i] = float(r * 1000 + i);
    std::vector<char> scratch;
    ExchangeAllreduce(*comm, exchanged.data(), count, DataType::kFloat32, ReduceOp::kSum, &scratch);
    RingScratch ring_scratch;
    RingAllreduce(*comm, ringed.data(), count, DataType::kFloat32, ReduceOp::kSum, segment_bytes,
                  &ring_scratch);
    const int connections = comm->connections();
    py::gil_scoped_acquire gil;
    (*result)["ands"] = ands;
    (*result)["payloads"] = payloads;
    (*result)["gathers"] = gathers;
    std::vector<py::bytes> as_bytes;
    for (const std::string& s : strings) as_bytes.emplace_back(s);
    (*result)["strings"] = as_bytes;
    (*result)["bcasts"] = bcasts;
    (*result)["exchange_allreduce"] = exchanged;
    (*result)["ring_allreduce"] = ringed;
    (*result)["connections"] = connections;
  });
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

// Rank 0 of a comm of two whose rank 1 is `address` ("ip:port host", a
// listener the test made): the first send makes the connection. Returns the
// error it raised, "" if none.
std::string TestingTcpConnectTo(const std::string& address) {
  py::gil_scoped_release release;
  try {
    TcpComm comm(0, 2, TcpOptions{},
                 [&](const std::string& mine) { return std::vector<std::string>{mine, address}; });
    char byte = 0;
    comm.Wait(comm.ISend(&byte, 1, 1));
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

void DefineTestingTcpBindings(py::module_& m) {
  m.def("tcp_collectives", &TestingTcpCollectives, py::arg("n"),
        py::arg("direct_bit_and_ranks") = 16, py::arg("count") = 100,
        py::arg("segment_bytes") = 64);
  m.def("tcp_peer_gone", &TestingTcpPeerGone, py::arg("n"), py::arg("how"));
  m.def("tcp_connect_to", &TestingTcpConnectTo, py::arg("address"));
}

}  // namespace hvdmx
