// Entry points for tests/test_comm_local.py, and what it shares with
// testing_tcp_bindings.cc: every collective of the Comm interface run by
// one body over any comm, here over LocalComm (comm/local_comm.h), whose
// broadcast, gather and bit-and are the ones TcpComm runs
// (comm/p2p_collectives.cc); and a peer that breaks the protocol.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "algorithms/adasum.h"
#include "algorithms/bruck.h"
#include "algorithms/exchange_allreduce.h"
#include "algorithms/ring.h"
#include "comm/local_comm.h"
#include "config/env_config.h"
#include "negotiation/round_reduction.h"
#include "shm/host_tree_comm.h"
#include "shm/shm_host.h"
#include "testing/testing_bindings.h"

namespace py = pybind11;

namespace hvdmx {

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

void RecordCollectives(Comm& comm, int64_t count, int64_t segment_bytes, py::dict* result) {
  const int r = comm.rank();
  const int n = comm.size();
  // Three bit-ands: rank r clears bit (r + round) of every word, and sends
  // a payload that says whose it is (none from rank 1 in round 1).
  std::vector<std::vector<uint64_t>> ands;
  std::vector<std::vector<std::string>> payloads;
  std::vector<int> hops;
  auto* p2p = dynamic_cast<P2PComm*>(&comm);
  const Traffic before = p2p != nullptr ? p2p->traffic() : Traffic();
  for (int round = 0; round < 3; ++round) {
    std::vector<uint64_t> words(3, ~uint64_t{0});
    for (uint64_t& w : words) w &= ~(uint64_t{1} << ((r + round) % 64));
    // Payloads travel only where the comm carries them (direct bit-ands).
    const bool carries = comm.BitAndPayloadCapacity() > 0;
    const std::string payload =
        !carries || (r == 1 && round == 1)
            ? ""
            : "payload of rank " + std::to_string(r) + " round " + std::to_string(round);
    comm.StartBitAndWithPayload(words.data(), 3, payload);
    while (!comm.TestBitAnd()) {
      if (comm.WakesOnArrival()) {
        comm.AwaitArrival(1000000);
      } else {
        std::this_thread::yield();
      }
    }
    ands.push_back(words);
    if (p2p != nullptr) hops.push_back(p2p->last_bit_and_hops());
    std::vector<std::string> got;
    if (r == 0 && carries) {
      for (int j = 0; j < n; ++j) got.push_back(comm.BitAndPayload(j));
    }
    payloads.push_back(got);
  }
  // What this rank sent and received in the three bit-ands.
  const Traffic after = p2p != nullptr ? p2p->traffic() : Traffic();
  std::vector<std::vector<std::string>> gathers;
  std::vector<std::string> strings;
  std::vector<std::vector<int>> bcasts;
  for (int root = 0; root < n; ++root) {
    gathers.push_back(comm.Gather(std::string(r, static_cast<char>('a' + root)), root));
    std::string s = r == root ? std::string(root * 1000 + 1, static_cast<char>('A' + root)) : "";
    comm.BcastString(&s, root);
    strings.push_back(s);
    std::vector<int> b(count, r == root ? root + 1 : -1);
    comm.Bcast(b.data(), count * 4, root);
    bcasts.push_back(b);
  }
  std::vector<float> exchanged(count), ringed(count);
  for (int64_t i = 0; i < count; ++i) exchanged[i] = ringed[i] = float(r * 1000 + i);
  std::vector<char> scratch;
  ExchangeAllreduce(comm, exchanged.data(), count, DataType::kFloat32, ReduceOp::kSum, &scratch);
  RingScratch ring_scratch;
  RingAllreduce(comm, ringed.data(), count, DataType::kFloat32, ReduceOp::kSum, segment_bytes,
                &ring_scratch);
  py::gil_scoped_acquire gil;
  (*result)["ands"] = ands;
  (*result)["payloads"] = payloads;
  (*result)["hops"] = hops;
  (*result)["bit_and_sent"] = after.sent_messages - before.sent_messages;
  (*result)["bit_and_received"] = after.received_messages - before.received_messages;
  (*result)["gathers"] = gathers;
  std::vector<py::bytes> as_bytes;
  for (const std::string& s : strings) as_bytes.emplace_back(s);
  (*result)["strings"] = as_bytes;
  (*result)["bcasts"] = bcasts;
  (*result)["exchange_allreduce"] = exchanged;
  (*result)["ring_allreduce"] = ringed;
}

// The byte at `k` of what rank `from` sends rank `to` in an alltoall.
uint8_t AlltoallByte(int from, int to, int64_t k) {
  return static_cast<uint8_t>((from * 31 + to * 7 + k) % 251);
}

void RecordDataCollectives(Comm& comm, const std::vector<int64_t>& matrix, int64_t count,
                           const std::vector<std::string>& host_keys, py::dict* result) {
  const int r = comm.rank();
  const int n = comm.size();
  // Alltoall: matrix[i * n + j] bytes from i to j.
  std::string in, out;
  int64_t out_bytes = 0;
  for (int j = 0; j < n; ++j) {
    for (int64_t k = 0; k < matrix[r * n + j]; ++k) in.push_back(AlltoallByte(r, j, k));
    out_bytes += matrix[j * n + r];
  }
  out.assign(static_cast<size_t>(out_bytes), '\xee');
  AlltoallScratch alltoall_scratch;
  for (int round = 0; round < 2; ++round) {  // twice: the scratch is reused
    Alltoall(comm, in.data(), &out[0], matrix, &alltoall_scratch);
  }
  // Bruck's allgather of `count` bytes a rank.
  std::string slots(static_cast<size_t>(count * n), '\0');
  for (int64_t k = 0; k < count; ++k) slots[r * count + k] = static_cast<char>('a' + (r + k) % 26);
  BruckAllgather(comm, &slots[0], count);
  // The ring's allgather and reduce-scatter over chunks of uneven sizes
  // (chunk c has c + count elements).
  std::vector<int64_t> starts(n + 1, 0);
  for (int c = 0; c < n; ++c) starts[c + 1] = starts[c] + c + count;
  std::vector<float> gathered(starts[n], -1.0f), scattered(starts[n]);
  for (int64_t i = starts[r]; i < starts[r + 1]; ++i) gathered[i] = float(r * 1000 + i);
  for (int64_t i = 0; i < starts[n]; ++i) scattered[i] = float(r * 1000 + i);
  RingScratch ring_scratch;
  RingAllgather(comm, gathered.data(), starts, DataType::kFloat32, &ring_scratch);
  RingReduceScatter(comm, scattered.data(), starts, DataType::kFloat32, ReduceOp::kSum, 64,
                    &ring_scratch);
  std::vector<float> mine_scattered(scattered.begin() + starts[r],
                                    scattered.begin() + starts[r + 1]);
  // Adasum over every rank, and hierarchical by the hosts of `host_keys`:
  // two tensors of count and count + 3 elements.
  const std::vector<int64_t> counts = {count, count + 3};
  auto adasum_input = [&] {
    std::vector<float> v(static_cast<size_t>(2 * count + 3));
    for (size_t i = 0; i < v.size(); ++i) v[i] = float((r * 7 + static_cast<int>(i) * 3) % 11 - 5);
    return v;
  };
  AdasumScratch adasum_scratch;
  std::vector<float> adasum = adasum_input();
  AdasumAllreduce(comm, {}, adasum.data(), counts, DataType::kFloat32, &adasum_scratch);
  std::vector<float> hierarchical;
  if (!host_keys.empty()) {
    hierarchical = adasum_input();
    HierarchicalAdasumAllreduce(comm, HostMap::FromKeys(host_keys), hierarchical.data(), counts,
                                DataType::kFloat32, &adasum_scratch);
  }
  py::gil_scoped_acquire gil;
  (*result)["alltoall"] = py::bytes(out);
  (*result)["bruck_allgather"] = py::bytes(slots);
  (*result)["ring_allgather"] = gathered;
  (*result)["ring_reducescatter"] = mine_scattered;
  (*result)["adasum"] = adasum;
  (*result)["hierarchical_adasum"] = hierarchical;
  (*result)["links_every_pair"] = comm.LinksEveryPair();
}

namespace {

// The ranks rank r of n links with in the data collectives' tests: every
// other ("all"), or P2PComm::DataPeers and, given host keys, the
// hierarchical Adasum's pairs ("data").
std::vector<int> TestLinks(const std::string& links, int r, int n,
                           const std::vector<std::string>& host_keys) {
  if (links == "all") {
    std::vector<int> every;
    for (int j = 0; j < n; ++j) {
      if (j != r) every.push_back(j);
    }
    return every;
  }
  return P2PComm::DataPeers(r, n,
                            host_keys.empty()
                                ? std::vector<int>()
                                : AdasumHierarchicalPeers(HostMap::FromKeys(host_keys), r));
}

// RecordCollectives (bit-ands by doubling beyond `direct_bit_and_ranks`)
// and RecordDataCollectives on n LocalComm ranks linked as TestLinks says.
std::vector<py::dict> TestingLocalDataCollectives(int n, const std::string& links,
                                                  const std::vector<int64_t>& matrix, int64_t count,
                                                  const std::vector<std::string>& host_keys,
                                                  int direct_bit_and_ranks) {
  if (static_cast<int>(matrix.size()) != n * n) throw py::value_error("matrix is not n x n");
  if (!host_keys.empty() && static_cast<int>(host_keys.size()) != n) {
    throw py::value_error("host_keys: one a rank");
  }
  auto world = std::make_shared<LocalWorld>(n);
  std::vector<std::vector<int>> all_links;
  for (int r = 0; r < n; ++r) all_links.push_back(TestLinks(links, r, n, host_keys));
  world->LinkOnly(all_links);
  py::gil_scoped_release release;
  return OnThreads(n, [&](int r, py::dict* result) {
    LocalComm comm(world, r, direct_bit_and_ranks);
    const std::vector<int>& linked = all_links[r];
    RecordCollectives(comm, count, 64, result);
    RecordDataCollectives(comm, matrix, count, host_keys, result);
    py::gil_scoped_acquire gil;
    (*result)["linked"] = linked;
  });
}

// Rank `from` of n LocalComm ranks linked by P2PComm::DataPeers posts a
// send (or, with `recv`, a receive) to rank `to`. Returns the error it
// raised, "" if none.
std::string TestingLocalUnlinked(int n, int from, int to, bool recv) {
  auto world = std::make_shared<LocalWorld>(n);
  std::vector<std::vector<int>> links;
  for (int r = 0; r < n; ++r) links.push_back(P2PComm::DataPeers(r, n));
  world->LinkOnly(links);
  LocalComm comm(world, from);
  char byte = 'x';
  try {
    comm.Wait(recv ? comm.IRecv(&byte, 1, to) : comm.ISend(&byte, 1, to));
  } catch (const UnlinkedPeerError& e) {
    return e.what();
  }
  return "";
}

// RecordCollectives on n LocalComm ranks, one thread each.
std::vector<py::dict> TestingLocalCollectives(int n, int direct_bit_and_ranks, int64_t count,
                                              int64_t segment_bytes) {
  auto world = std::make_shared<LocalWorld>(n);
  py::gil_scoped_release release;
  return OnThreads(n, [&](int r, py::dict* result) {
    LocalComm comm(world, r, direct_bit_and_ranks);
    RecordCollectives(comm, count, segment_bytes, result);
  });
}

// Rank `victim` (0 or 1) of a LocalComm pair whose other rank sends
// `bytes` bytes and then nothing else, while the victim waits for its part
// of `what`: "recv" (a message of exactly 8 bytes) or "bit_and" (one word,
// then a partial's 8-byte length; rank 0 may be sent a payload after it,
// rank 1 not). In a bit-and the length says 0 (when the bytes reach it),
// or with "bit_and_partial" one byte more than follows it. Returns the
// PeerProtocolError it raised, "" if none.
std::string TestingLocalLyingPeer(const std::string& what, int victim, int64_t bytes) {
  auto world = std::make_shared<LocalWorld>(2);
  LocalComm comm(world, victim);
  LocalComm liar(world, 1 - victim);
  try {
    std::string lie(static_cast<size_t>(bytes), 'x');
    if (what != "recv" && bytes >= 16) {
      const uint64_t length = what == "bit_and_partial" ? static_cast<uint64_t>(bytes - 15) : 0;
      std::memcpy(&lie[8], &length, 8);
    }
    liar.Wait(liar.ISend(lie.data(), bytes, victim));
    if (what == "recv") {
      uint64_t word = 0;
      comm.Wait(comm.IRecv(&word, 8, 1 - victim));
    } else {
      uint64_t word = ~uint64_t{0};
      comm.StartBitAnd(&word, 1);
      while (!comm.TestBitAnd()) std::this_thread::yield();
    }
  } catch (const PeerProtocolError& e) {
    return e.what();
  }
  return "";
}

// What rank r gathers to rank 0 in round `round` of TestingHostTree:
// lengths from 0 to past two shared-memory mailboxes.
std::string GatherString(int r, int round, int64_t big) {
  const int64_t len = (r * 7 + round * 3) % 5 == 0 ? big + r : r * 11 + round;
  return std::string(static_cast<size_t>(len), static_cast<char>('a' + (r + round) % 26));
}

// The negotiation's collectives over HostTreeComm (shm/host_tree_comm.h):
// hosts[h] lists the global ranks of host h (the same number on each, the
// lowest first; rank 0 on host 0), one thread each, a host's ranks sharing
// plain memory, the leaders a LocalComm. Three rounds of a bit-and (rank r
// clears bit r + round of each of 3 words), a gather to rank 0 of
// GatherString(r, round, big) and a broadcast from it of `big` + round
// bytes. Per rank: the ANDs, the hops, the gathers (rank 0), the strings,
// and the messages its leaders' comm sent and received in the bit-ands.
std::vector<py::dict> TestingHostTree(const std::vector<std::vector<int>>& hosts,
                                      int direct_bit_and_ranks, int64_t big) {
  const int n_hosts = static_cast<int>(hosts.size());
  const int per_host = static_cast<int>(hosts.at(0).size());
  const int size = n_hosts * per_host;
  std::vector<std::unique_ptr<PlainShmRegions>> memory;
  std::vector<std::pair<int, int>> where(size, {-1, -1});  // rank -> (host, local rank)
  for (int h = 0; h < n_hosts; ++h) {
    if (static_cast<int>(hosts[h].size()) != per_host) throw py::value_error("unequal hosts");
    memory.push_back(std::make_unique<PlainShmRegions>(per_host, 4096));
    for (int l = 0; l < per_host; ++l) where.at(hosts[h][l]) = {h, l};
  }
  auto world = std::make_shared<LocalWorld>(n_hosts);
  py::gil_scoped_release release;
  return OnThreads(size, [&](int r, py::dict* result) {
    const int h = where[r].first, l = where[r].second;
    ShmHost shm(l, per_host, memory[h]->regions, 4096, memory[h]->memory, nullptr);
    std::unique_ptr<P2PComm> leaders;
    if (l == 0) leaders = std::make_unique<LocalComm>(world, h, direct_bit_and_ranks);
    HostTreeComm comm(&shm.control(), l, per_host, std::move(leaders), r, size);
    std::vector<std::vector<uint64_t>> ands;
    std::vector<int> hops;
    std::vector<std::vector<std::string>> gathers;
    std::vector<std::string> strings;
    Traffic before, after;
    for (int round = 0; round < 3; ++round) {
      std::vector<uint64_t> words(3, ~uint64_t{0});
      for (uint64_t& w : words) w &= ~(uint64_t{1} << ((r + round) % 64));
      if (comm.leaders()) before = comm.leaders()->traffic();
      comm.StartBitAnd(words.data(), 3);
      while (!comm.TestBitAnd()) {
        if (comm.WakesOnArrival()) comm.AwaitArrival(1000);
        std::this_thread::yield();
      }
      if (comm.leaders()) after = comm.leaders()->traffic();
      ands.push_back(words);
      hops.push_back(comm.last_bit_and_hops());
      gathers.push_back(comm.Gather(GatherString(r, round, big), 0));
      std::string s = r == 0 ? std::string(static_cast<size_t>(big + round), 'A' + round) : "x";
      comm.BcastString(&s, 0);
      strings.push_back(s);
    }
    py::gil_scoped_acquire gil;
    (*result)["ands"] = ands;
    (*result)["hops"] = hops;
    (*result)["gathers"] = gathers;
    std::vector<py::bytes> as_bytes;
    for (const std::string& s : strings) as_bytes.emplace_back(s);
    (*result)["strings"] = as_bytes;
    (*result)["bit_and_sent"] = after.sent_messages - before.sent_messages;
    (*result)["bit_and_received"] = after.received_messages - before.received_messages;
  });
}

// One combining bit-and (Note [Small tensors in the round] in
// negotiation/round_reduction.h) over hosts x per_host ranks, one thread
// each: a LocalComm over the hosts' leaders (direct up to
// `direct_bit_and_ranks` hosts), under a HostTreeComm when per_host > 1
// (rank h * per_host + l is local rank l of host h). Every rank's cache
// holds a float32 Sum allreduce of len(values[0]) elements at slot 0;
// rank r gives values[r] as its operand, or leaves the slot out when
// values[r] is empty; rank `liar` gives the bytes `lie` as its partial
// instead. Per rank: "reduced", the slot's reduced operand (None when the
// combination lacks it), and "error".
std::vector<py::dict> TestingRoundBitAnd(int hosts, int per_host, int direct_bit_and_ranks,
                                         const std::vector<std::vector<float>>& values, int liar,
                                         const std::string& lie) {
  const int size = hosts * per_host;
  if (static_cast<int>(values.size()) != size) throw py::value_error("one operand per rank");
  std::vector<std::unique_ptr<PlainShmRegions>> memory;
  for (int h = 0; h < hosts && per_host > 1; ++h) {
    memory.push_back(std::make_unique<PlainShmRegions>(per_host, 4096));
  }
  auto world = std::make_shared<LocalWorld>(hosts);
  Request request;
  request.name = "t";
  request.dtypes = {DataType::kFloat32};
  request.shapes = {{static_cast<int64_t>(values[0].size())}};
  const Response response = MakeResponse({request});
  py::gil_scoped_release release;
  return OnThreads(size, [&](int r, py::dict* result) {
    const int h = r / per_host, l = r % per_host;
    ResponseCache cache(4);
    cache.Put(request, response);
    const RoundReduction reduction(cache, Config::kMaxRoundAllreduceBytes);
    BitAndPartial partial;
    partial.reduction = &reduction;
    if (r == liar) {
      partial.mine = lie;
    } else if (!values[r].empty() && reduction.Takes(0, 0)) {
      reduction.Append(0, {values[r].data()}, &partial.mine);
    }
    std::unique_ptr<P2PComm> leaders;
    if (l == 0) leaders = std::make_unique<LocalComm>(world, h, direct_bit_and_ranks);
    std::unique_ptr<ShmHost> shm;
    std::unique_ptr<ControlComm> comm;
    if (per_host > 1) {
      shm = std::make_unique<ShmHost>(l, per_host, memory[h]->regions, 4096, memory[h]->memory,
                                      nullptr);
      comm =
          std::make_unique<HostTreeComm>(&shm->control(), l, per_host, std::move(leaders), r, size);
    } else {
      comm = std::move(leaders);
    }
    uint64_t word = ~uint64_t{0};
    comm->StartBitAndCombining(&word, 1, "", &partial);
    while (!comm->TestBitAnd()) std::this_thread::yield();
    const std::map<int64_t, std::string> records =
        reduction.Records(partial.combined, PeerSender::Rank(r));
    py::gil_scoped_acquire gil;
    auto it = records.find(0);
    (*result)["reduced"] =
        it == records.end() ? py::object(py::none()) : py::object(py::bytes(it->second));
  });
}

}  // namespace

void DefineTestingCommBindings(py::module_& m) {
  m.def("round_bit_and", &TestingRoundBitAnd, py::arg("hosts"), py::arg("per_host"),
        py::arg("direct_bit_and_ranks"), py::arg("values"), py::arg("liar") = -1,
        py::arg("lie") = py::bytes());
  m.def("host_tree", &TestingHostTree, py::arg("hosts"), py::arg("direct_bit_and_ranks"),
        py::arg("big"));
  m.def("gather_string", &GatherString, py::arg("rank"), py::arg("round"), py::arg("big"));
  m.def(
      "data_peers", [](int rank, int size) { return P2PComm::DataPeers(rank, size); },
      py::arg("rank"), py::arg("size"));
  m.def(
      "adasum_hierarchical_peers",
      [](const std::vector<std::string>& keys, int rank) {
        return AdasumHierarchicalPeers(HostMap::FromKeys(keys), rank);
      },
      py::arg("keys"), py::arg("rank"));
  m.def("local_data_collectives", &TestingLocalDataCollectives, py::arg("n"), py::arg("links"),
        py::arg("matrix"), py::arg("count"), py::arg("host_keys"),
        py::arg("direct_bit_and_ranks") = 1);
  m.def("local_unlinked", &TestingLocalUnlinked, py::arg("n"), py::arg("from_rank"),
        py::arg("to_rank"), py::arg("recv") = false);
  m.def("negotiation_peers", &P2PComm::NegotiationPeers, py::arg("rank"), py::arg("size"),
        py::arg("direct_bit_and_ranks"));
  m.def("local_collectives", &TestingLocalCollectives, py::arg("n"),
        py::arg("direct_bit_and_ranks") = P2PComm::kDirectBitAndRanks, py::arg("count") = 100,
        py::arg("segment_bytes") = 64);
  m.def("local_lying_peer", &TestingLocalLyingPeer, py::arg("what"), py::arg("victim"),
        py::arg("bytes"));
}

}  // namespace hvdmx
