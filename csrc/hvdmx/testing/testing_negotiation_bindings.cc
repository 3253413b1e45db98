// Entry points for tests/test_peer_input.py: the negotiation's wire format
// parsed in process (request lists, response lists, a round's partial, a
// gather), and a round in which one rank sends the coordinator bytes that
// break the protocol. A parse that fails raises
// _hvdmx_testing.PeerProtocolError with args (message, peer rank).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/local_comm.h"
#include "comm/peer_input.h"
#include "config/env_config.h"
#include "negotiation/controller.h"
#include "negotiation/message.h"
#include "negotiation/round_reduction.h"
#include "testing/testing_bindings.h"

namespace py = pybind11;

namespace hvdmx {
namespace {

// _hvdmx_testing.PeerProtocolError, made once when the module loads.
PyObject* peer_error_class = nullptr;

// Runs `parse`; a PeerProtocolError becomes the Python exception.
template <typename F>
auto RaisingPeerErrors(F parse) -> decltype(parse()) {
  try {
    return parse();
  } catch (const PeerProtocolError& e) {
    py::tuple args = py::make_tuple(py::str(e.what()), e.peer());
    PyErr_SetObject(peer_error_class, args.ptr());
    throw py::error_already_set();
  }
}

py::dict RequestDict(const Request& q) {
  py::dict d;
  d["rank"] = q.rank;
  d["type"] = static_cast<int>(q.type);
  d["name"] = py::bytes(q.name);
  std::vector<int> dtypes;
  for (DataType t : q.dtypes) dtypes.push_back(static_cast<int>(t));
  d["dtypes"] = dtypes;
  d["shapes"] = q.shapes;
  d["op"] = static_cast<int>(q.op);
  d["root"] = q.root;
  d["pre"] = q.scale.pre;
  d["post"] = q.scale.post;
  d["device"] = q.device;
  d["sizes_only"] = q.sizes_only;
  d["splits"] = q.splits;
  d["stalled"] = q.stalled;
  d["error"] = py::bytes(q.error);
  return d;
}

Request RequestFrom(const py::dict& d) {
  Request q;
  q.rank = d["rank"].cast<int32_t>();
  q.type = static_cast<CollectiveType>(d["type"].cast<int32_t>());
  q.name = d["name"].cast<std::string>();
  for (int t : d["dtypes"].cast<std::vector<int>>()) q.dtypes.push_back(static_cast<DataType>(t));
  q.shapes = d["shapes"].cast<std::vector<std::vector<int64_t>>>();
  q.op = static_cast<ReduceOp>(d["op"].cast<int32_t>());
  q.root = d["root"].cast<int32_t>();
  q.scale = Scale{d["pre"].cast<double>(), d["post"].cast<double>()};
  q.device = d["device"].cast<int32_t>();
  q.sizes_only = d["sizes_only"].cast<bool>();
  q.splits = d["splits"].cast<std::vector<int64_t>>();
  q.stalled = d["stalled"].cast<bool>();
  q.error = d["error"].cast<std::string>();
  return q;
}

py::dict ResponseDict(const Response& p) {
  py::dict d;
  d["type"] = static_cast<int>(p.type);
  d["name"] = py::bytes(p.name);
  std::vector<int> dtypes;
  for (DataType t : p.dtypes) dtypes.push_back(static_cast<int>(t));
  d["dtypes"] = dtypes;
  d["counts"] = p.counts;
  d["op"] = static_cast<int>(p.op);
  d["root"] = p.root;
  d["pre"] = p.scale.pre;
  d["post"] = p.scale.post;
  d["sizes_only"] = p.sizes_only;
  d["splits"] = p.splits;
  d["error"] = py::bytes(p.error);
  return d;
}

Response ResponseFrom(const py::dict& d) {
  Response p;
  p.type = static_cast<CollectiveType>(d["type"].cast<int32_t>());
  p.name = d["name"].cast<std::string>();
  for (int t : d["dtypes"].cast<std::vector<int>>()) p.dtypes.push_back(static_cast<DataType>(t));
  p.counts = d["counts"].cast<std::vector<int64_t>>();
  p.op = static_cast<ReduceOp>(d["op"].cast<int32_t>());
  p.root = d["root"].cast<int32_t>();
  p.scale = Scale{d["pre"].cast<double>(), d["post"].cast<double>()};
  p.sizes_only = d["sizes_only"].cast<bool>();
  p.splits = d["splits"].cast<std::vector<int64_t>>();
  p.error = d["error"].cast<std::string>();
  return p;
}

py::bytes SerializeRequestDicts(const std::vector<py::dict>& dicts, py::object slots) {
  std::vector<Request> requests;
  for (const py::dict& d : dicts) requests.push_back(RequestFrom(d));
  if (slots.is_none()) return py::bytes(SerializeRequests(requests));
  const auto s = slots.cast<std::vector<int64_t>>();
  if (s.size() != requests.size()) throw py::value_error("one cache slot per request");
  return py::bytes(SerializeRequests(requests, s));
}

// Without `cache_capacity` (None): a request list; with it, the list with
// cache slots, returned as (requests, slots).
py::object ParseRequestBytes(const py::bytes& data, int sender, int size,
                             py::object cache_capacity) {
  const std::string bytes = data;
  return RaisingPeerErrors([&]() -> py::object {
    std::vector<int64_t> slots;
    const std::vector<Request> requests =
        cache_capacity.is_none() ? ParseRequests(bytes, PeerSender::Rank(sender), size)
                                 : ParseRequests(bytes, PeerSender::Rank(sender), size,
                                                 cache_capacity.cast<int64_t>(), &slots);
    py::list out;
    for (const Request& q : requests) out.append(RequestDict(q));
    if (cache_capacity.is_none()) return std::move(out);
    return py::make_tuple(out, slots);
  });
}

py::bytes SerializeResponseDicts(const std::vector<py::dict>& dicts) {
  std::vector<Response> responses;
  for (const py::dict& d : dicts) responses.push_back(ResponseFrom(d));
  return py::bytes(SerializeResponses(responses));
}

py::list ParseResponseBytes(const py::bytes& data, int sender, int size) {
  const std::string bytes = data;
  return RaisingPeerErrors([&]() {
    py::list out;
    for (const Response& p : ParseResponses(bytes, PeerSender::Rank(sender), size)) {
      out.append(ResponseDict(p));
    }
    return out;
  });
}

// CheckResponseFits of `response` (from rank 0) for this rank's `request`.
void CheckResponseFitsDicts(const py::dict& request, const py::dict& response) {
  RaisingPeerErrors([&]() {
    CheckResponseFits(RequestFrom(request), ResponseFrom(response), PeerSender::Rank(0));
    return 0;
  });
}

// A cache of float32 Sum allreduces of counts[s] elements at slot s, and
// the records that `data`, a bit-and partial from `sender`, holds for it:
// [(slot, operand bytes)].
std::vector<std::pair<int64_t, int64_t>> ParseRoundPartial(const py::bytes& data, int sender,
                                                           const std::vector<int64_t>& counts) {
  const std::string bytes = data;
  ResponseCache cache(static_cast<int64_t>(counts.size()));
  for (size_t s = 0; s < counts.size(); ++s) {
    Request q;
    q.name = "t" + std::to_string(s);
    q.dtypes = {DataType::kFloat32};
    q.shapes = {{counts[s]}};
    cache.Put(q, MakeResponse({q}));
  }
  const RoundReduction reduction(cache, Config::kMaxRoundAllreduceBytes);
  return RaisingPeerErrors([&]() {
    std::vector<std::pair<int64_t, int64_t>> out;
    for (const auto& record : reduction.Records(bytes, PeerSender::Rank(sender))) {
      out.emplace_back(record.first, static_cast<int64_t>(record.second.size()));
    }
    return out;
  });
}

std::vector<std::pair<uint32_t, py::bytes>> ParseGatherBytes(const py::bytes& data, int sender,
                                                             int size) {
  const std::string bytes = data;
  return RaisingPeerErrors([&]() {
    std::vector<std::pair<uint32_t, std::string>> records;
    ParseGatherRecords(bytes, PeerSender::Rank(sender), size, &records);
    std::vector<std::pair<uint32_t, py::bytes>> out;
    for (auto& r : records) out.emplace_back(r.first, py::bytes(r.second));
    return out;
  });
}

// One negotiation round over `size` LocalComm ranks, one thread each, with
// bit-ands direct: every rank but `liar` runs a Controller (cache capacity
// 16) and submits a float32 allreduce "t"; rank `liar` takes part in the
// round by hand and sends the coordinator `lie` as its request list, in
// the gather (how == "gather") or with the bit-and ("payload"), or sends
// `lie` as its whole gather message, records and all ("frame"; rank 0 must
// be the liar's parent in the gather's tree: a power of two), or sends
// rank size - 1 `lie` as its bit-and message and the others an honest one
// without requests (its list comes by the gather), then takes part in
// nothing more ("bitand"). An honest rank that throws PeerProtocolError
// reports it (ControlComm::ReportStop), as the runtime does
// (Runtime::StopAfterPeer). Each thread
// gives up after `timeout` seconds. Per rank: "error" (what it
// threw, "" if nothing), "peer" (the rank its PeerProtocolError named, -1
// if none) and "abandoned" (its round gave up waiting).
std::vector<py::dict> NegotiationLiar(int size, int liar, const std::string& how,
                                      const py::bytes& lie_bytes, double timeout) {
  if (how != "gather" && how != "payload" && how != "frame" && how != "bitand") {
    throw py::value_error("how: 'gather', 'payload', 'frame' or 'bitand'");
  }
  if (how == "bitand" && liar == size - 1) throw py::value_error("bitand: a liar below size - 1");
  if (liar < 0 || liar >= size) throw py::value_error("liar: a rank");
  if (how == "frame" && (liar == 0 || (liar & (liar - 1)) != 0)) {
    throw py::value_error("frame: the liar's parent must be rank 0");
  }
  const std::string lie = lie_bytes;
  constexpr int64_t kCapacity = 16;
  auto world = std::make_shared<LocalWorld>(size);
  std::vector<int> peers(size, -1);
  std::vector<int> abandoned(size, 0);
  py::gil_scoped_release release;
  std::vector<py::dict> results = OnThreads(size, [&](int r, py::dict*) {
    LocalComm comm(world, r, P2PComm::kDirectBitAndRanks);
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                              std::chrono::duration<double>(timeout));
    const auto idle = [deadline](int64_t) { return std::chrono::steady_clock::now() < deadline; };
    comm.set_idle(idle);
    try {
      if (r != liar) {
        Controller controller(comm, kCapacity);
        Request q;
        q.rank = r;
        q.name = "t";
        q.dtypes = {DataType::kFloat32};
        q.shapes = {{4}};
        try {
          abandoned[r] = controller.RunRound({q}, false, {}, idle).abandoned;
        } catch (const PeerProtocolError& e) {
          controller.ReportStop(e.what());
          throw;
        }
        return;
      }
      std::vector<uint64_t> bits(Controller::BitWords(kCapacity), ~uint64_t{0});
      bits[0] &= ~uint64_t{1};                        // something for the coordinator
      if (how != "payload") bits[0] &= ~uint64_t{4};  // nothing sent with the bit-and
      if (how == "bitand") {
        // A direct bit-and's message: the words, the partial's length, the partial.
        std::string honest(reinterpret_cast<const char*>(bits.data()), bits.size() * 8);
        honest.append(8, '\0');
        for (int j = 0; j < size; ++j) {
          if (j == r) continue;
          const std::string& message = j == size - 1 ? lie : honest;
          comm.Wait(comm.ISend(message.data(), static_cast<int64_t>(message.size()), j));
        }
        return;
      }
      comm.StartBitAndWithPayload(bits.data(), static_cast<int>(bits.size()),
                                  how == "payload" ? lie : std::string());
      for (int64_t i = 0; !comm.TestBitAnd(); ++i) {
        if (!idle(i)) {
          abandoned[r] = 1;
          return;
        }
      }
      if (how == "frame") {
        comm.Wait(comm.ISend(lie.data(), static_cast<int64_t>(lie.size()), 0));
      } else if ((bits[0] & 4) == 0) {
        comm.Gather(how == "gather" ? lie : SerializeRequests({}), 0);
      }
      std::string wire;
      comm.BcastString(&wire, 0);
      ParseResponses(wire, PeerSender::Rank(0), size);
    } catch (const PeerProtocolError& e) {
      peers[r] = e.peer();
      throw;
    } catch (const CommAbandoned&) {
      abandoned[r] = 1;
    }
  });
  py::gil_scoped_acquire gil;
  for (int r = 0; r < size; ++r) {
    results[r]["peer"] = peers[r];
    results[r]["abandoned"] = abandoned[r] != 0;
  }
  return results;
}

}  // namespace

void DefineTestingNegotiationBindings(py::module_& m) {
  peer_error_class =
      PyErr_NewException("_hvdmx_testing.PeerProtocolError", PyExc_RuntimeError, nullptr);
  m.attr("PeerProtocolError") = py::handle(peer_error_class);
  m.def("serialize_requests", &SerializeRequestDicts, py::arg("requests"),
        py::arg("slots") = py::none());
  m.def("parse_requests", &ParseRequestBytes, py::arg("data"), py::arg("sender"), py::arg("size"),
        py::arg("cache_capacity") = py::none());
  m.def("serialize_responses", &SerializeResponseDicts, py::arg("responses"));
  m.def(
      "serialize_peer_failure",
      [](int rank, const std::string& message) {
        return py::bytes(SerializePeerFailure(rank, message));
      },
      py::arg("rank"), py::arg("message"));
  m.def("parse_responses", &ParseResponseBytes, py::arg("data"), py::arg("sender"),
        py::arg("size"));
  m.def("check_response_fits", &CheckResponseFitsDicts, py::arg("request"), py::arg("response"));
  m.def("parse_round_partial", &ParseRoundPartial, py::arg("data"), py::arg("sender"),
        py::arg("counts"));
  m.def("parse_gather", &ParseGatherBytes, py::arg("data"), py::arg("sender"), py::arg("size"));
  m.def("negotiation_liar", &NegotiationLiar, py::arg("size"), py::arg("liar"), py::arg("how"),
        py::arg("lie"), py::arg("timeout") = 20.0);
}

}  // namespace hvdmx
