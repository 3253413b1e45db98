// Entry points for the test suite into the shared-memory collectives
// (_hvdmx_testing.shm_* and a few more): ShmHost (shm_host.h) driven in one process, one
// thread per rank over plain memory. Nothing here is used by hvdmx itself.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "algorithms/ring.h"
#include "comm/local_comm.h"
#include "platform/huge_pages.h"
#include "platform/stage_stores.h"
#include "shm/shm_control_comm.h"
#include "shm/shm_host.h"
#include "testing/testing_bindings.h"

namespace py = pybind11;

namespace hvdmx {

namespace {

StageStores CheckedStores(int stores) {
  if (stores < 0 || stores > static_cast<int>(StageStores::kStreaming)) {
    throw py::value_error("stores must be 0 (auto), 1 (cached) or 2 (streaming)");
  }
  return static_cast<StageStores>(stores);
}

// StageStoreChooser on made-up timings: calls[i] = (bytes, seconds if
// cached, seconds if streaming); returns whether each call streamed.
std::vector<bool> TestingStageStoreChooser(
    int stores, const std::vector<std::tuple<int64_t, double, double>>& calls) {
  StageStoreChooser chooser(CheckedStores(stores));
  std::vector<bool> streamed;
  for (const auto& [bytes, cached, streaming] : calls) {
    const bool s = chooser.Streams(bytes);
    chooser.Took(bytes, s, s ? streaming : cached);
    streamed.push_back(s);
  }
  return streamed;
}

// StreamingCopy from src to dst (arrays of equal byte length), then the fence.
void TestingStreamingCopy(py::array dst, const py::array& src) {
  if (dst.nbytes() != src.nbytes()) throw py::value_error("dst and src differ in length");
  StreamingCopy(dst.mutable_data(), src.data(), dst.nbytes());
  StreamingStoresFence();
}

// HugePageCollapser::Collapse over each array in turn, with one collapser;
// returns the huge pages it collapsed and those the kernel refused.
std::pair<int64_t, int64_t> TestingCollapseHugePages(const std::vector<py::array>& arrays) {
  HugePageCollapser collapser;
  for (const py::array& a : arrays) collapser.Collapse(a.data(), a.nbytes());
  return {collapser.collapsed(), collapser.refused()};
}

// Runs ShmAllreduce in one process, one thread per rank over plain memory:
// calls[c][r] is rank r's list of arrays in call c, reduced in place as one
// fused allreduce of their concatenation (ShmAllreduce::Span), calls in order,
// each result multiplied by `scale.post` inside the allreduce (a half dtype's
// operands by `scale.pre` too).
// With hosts > 1, runs of size/hosts consecutive ranks are hosts, each with
// its own memory, and the ring over LocalComm joins them (hierarchical).
// `stores` (0 auto, 1 cached, 2 streaming) sets every rank's StageStores;
// returns the calls each rank streamed.
std::vector<int64_t> TestingShmAllreduce(std::vector<std::vector<std::vector<py::array>>> calls,
                                         int dtype, int op, int64_t chunk_bytes, int hosts,
                                         Scale scale,
                                         std::vector<std::vector<std::vector<py::array>>> outputs,
                                         int stores) {
  DataType t = CheckedType(dtype);
  const StageStores stage_stores = CheckedStores(stores);
  if (calls.empty()) return {};
  const int n = static_cast<int>(calls[0].size());
  if (hosts < 1 || n % hosts != 0) throw py::value_error("hosts must divide the rank count");
  const int local = n / hosts;
  // With outputs (shaped like calls), out of place: each span reads its
  // input array and writes its output array.
  const bool out_of_place = !outputs.empty();
  std::vector<std::vector<std::vector<ShmAllreduce::Span>>> spans(calls.size());
  for (size_t c = 0; c < calls.size(); ++c) {
    if (static_cast<int>(calls[c].size()) != n) throw py::value_error("one list per rank");
    for (size_t r = 0; r < calls[c].size(); ++r) {
      spans[c].emplace_back();
      for (size_t i = 0; i < calls[c][r].size(); ++i) {
        py::array& a = calls[c][r][i];
        const int64_t count = a.nbytes() / static_cast<int64_t>(DataTypeSize(t));
        if (!out_of_place) {
          spans[c].back().push_back({a.mutable_data(), count});
          continue;
        }
        py::array& o = outputs.at(c).at(r).at(i);
        if (o.nbytes() != a.nbytes()) throw py::value_error("an output unlike its input");
        spans[c].back().push_back({o.mutable_data(), count, a.data()});
      }
    }
  }
  py::gil_scoped_release release;
  std::vector<PlainShmRegions> host_memory;  // each host its own
  for (int h = 0; h < hosts; ++h) host_memory.emplace_back(local, chunk_bytes);
  std::vector<std::shared_ptr<LocalWorld>> cross_worlds;
  for (int l = 0; l < local; ++l) cross_worlds.push_back(std::make_shared<LocalWorld>(hosts));
  std::vector<std::thread> threads;
  std::vector<int64_t> streamed(n);
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      const int h = r / local, l = r % local;
      ShmAllreduce::CrossAllreduce cross;
      if (hosts > 1) {
        auto comm = std::make_shared<LocalComm>(cross_worlds[l], h);
        auto scratch = std::make_shared<RingScratch>();
        cross = [comm, scratch](void* buf, float* wide, int64_t count, DataType dtype, ReduceOp op,
                                double postscale) {
          RingCrossAllreduce(*comm, buf, wide, count, dtype, op, postscale,
                             /*wide_partials=*/true, 4096, scratch.get());
        };
      }
      ShmHost shm(l, local, host_memory[h].regions, chunk_bytes, host_memory[h].memory, cross, -1,
                  stage_stores);
      for (size_t c = 0; c < calls.size(); ++c) {
        shm.allreduce().Allreduce(spans[c][r], t, static_cast<ReduceOp>(op), scale);
      }
      streamed[r] = shm.stats().streamed_calls;
    });
  }
  for (auto& th : threads) th.join();
  return streamed;
}

// One call of a mixed sequence for TestingShmSequence.
struct ShmTestCall {
  std::string kind;            // allreduce, broadcast, allgather, alltoall, reducescatter
  std::vector<py::array> in;   // one per rank (allreduce, broadcast: in place)
  std::vector<py::array> out;  // allgather, alltoall, reducescatter, broadcast out of
                               // place: one per rank
  std::vector<int64_t> ints;   // allreduce: dtype, op; broadcast: root;
                               // allgather: byte offsets; alltoall: byte matrix;
                               // reducescatter: dtype, op, element offsets;
                               // bitand: none (in: uint64 words, ANDed in place)
};

// Runs a sequence of mixed shared-memory calls in one process, one thread per
// rank over plain memory (one host), every rank making the same calls in
// the same order: interleaving must keep the chunk numbering in step.
// Byte-moving calls of at least `direct_min_bytes` (>= 0) read the peers'
// buffers directly (here: this process's own memory). With `push` (one
// flag per rank), the ranks may write into each other's outputs
// (WriteIntoPeers, outputs of a byte or more), and rank r's allgather,
// alltoall and out-of-place broadcast outputs lie in the one plain "file"
// all ranks share here when push[r]: copied there before the call (an input
// inside the output goes with it) and back after. Returns the calls that
// read directly and those that wrote into peers' outputs, as rank 0 counted
// them, and the direct broadcasts whose root wrote into its peers' outputs.
// `stores` as in TestingShmAllreduce.
std::tuple<int64_t, int64_t, int64_t> TestingShmSequence(const std::vector<py::tuple>& raw,
                                                         int64_t chunk_bytes,
                                                         int64_t direct_min_bytes, int stores,
                                                         const std::vector<bool>& push) {
  const StageStores stage_stores = CheckedStores(stores);
  std::vector<ShmTestCall> calls;
  for (const py::tuple& t : raw) {
    calls.push_back({t[0].cast<std::string>(), t[1].cast<std::vector<py::array>>(),
                     t[2].cast<std::vector<py::array>>(), t[3].cast<std::vector<int64_t>>()});
  }
  if (calls.empty()) return {0, 0, 0};
  const int n = static_cast<int>(calls[0].in.size());
  if (!push.empty() && static_cast<int>(push.size()) != n) {
    throw py::value_error("one push flag per rank");
  }
  std::vector<std::vector<char*>> in(calls.size()), out(calls.size());
  // Sizes read here, with the GIL: nbytes() touches the array's dtype object.
  std::vector<std::vector<int64_t>> in_bytes(calls.size()), out_bytes(calls.size());
  for (size_t c = 0; c < calls.size(); ++c) {
    if (static_cast<int>(calls[c].in.size()) != n) throw py::value_error("one input per rank");
    for (auto& a : calls[c].in) {
      in[c].push_back(static_cast<char*>(a.mutable_data()));
      in_bytes[c].push_back(a.nbytes());
    }
    for (auto& a : calls[c].out) {
      out[c].push_back(static_cast<char*>(a.mutable_data()));
      out_bytes[c].push_back(a.nbytes());
    }
    const std::string& k = calls[c].kind;
    if (k != "allreduce" && k != "broadcast" && k != "allgather" && k != "alltoall" &&
        k != "bitand" && k != "reducescatter") {
      throw py::value_error("unknown kind " + k);
    }
  }
  // Where each pushing rank's allgather and alltoall outputs lie in the file.
  std::vector<std::vector<int64_t>> at(calls.size(), std::vector<int64_t>(n, -1));
  int64_t file_bytes = 64;
  for (size_t c = 0; c < calls.size() && !push.empty(); ++c) {
    const std::string& k = calls[c].kind;
    // An out-of-place broadcast's output may lie in the file too.
    if (k != "allgather" && k != "alltoall" && (k != "broadcast" || out[c].empty())) continue;
    for (int r = 0; r < n; ++r) {
      if (!push[r]) continue;
      at[c][r] = file_bytes;
      file_bytes += out_bytes[c][r] + 64;
    }
  }
  std::vector<char> file(static_cast<size_t>(file_bytes));
  py::gil_scoped_release release;
  const PlainShmRegions host(n, chunk_bytes);
  std::vector<std::thread> threads;
  int64_t direct = 0, pushed = 0;
  std::atomic<int64_t> root_writes{0};
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      ShmHost shm(r, n, host.regions, chunk_bytes, host.memory, nullptr, direct_min_bytes,
                  stage_stores);
      if (!push.empty())
        shm.exchange().WriteIntoPeers(std::vector<char*>(n, file.data()), file_bytes, 1);
      for (size_t c = 0; c < calls.size(); ++c) {
        const ShmTestCall& call = calls[c];
        char* src = in[c][r];
        char* dst = out[c].empty() ? nullptr : out[c][r];
        if (at[c][r] >= 0) {  // the output moves into the file, an input inside it too
          dst = file.data() + at[c][r];
          std::memcpy(dst, out[c][r], out_bytes[c][r]);
          if (src >= out[c][r] && src < out[c][r] + out_bytes[c][r]) {
            src = dst + (src - out[c][r]);
          }
        }
        if (call.kind == "allreduce") {
          const DataType t = static_cast<DataType>(call.ints[0]);
          shm.allreduce().Allreduce(src, in_bytes[c][r] / static_cast<int64_t>(DataTypeSize(t)), t,
                                    static_cast<ReduceOp>(call.ints[1]));
        } else if (call.kind == "broadcast") {
          // In place without outputs.
          shm.exchange().Broadcast(src, dst ? dst : src, in_bytes[c][r],
                                   static_cast<int>(call.ints[0]));
        } else if (call.kind == "allgather") {
          shm.exchange().Allgather(src, dst, call.ints);
        } else if (call.kind == "reducescatter") {
          const std::vector<int64_t> starts(call.ints.begin() + 2, call.ints.end());
          shm.allreduce().ReduceScatter(src, dst, starts, static_cast<DataType>(call.ints[0]),
                                        static_cast<ReduceOp>(call.ints[1]), 1.0);
        } else if (call.kind == "bitand") {
          shm.control().StartBitAnd(reinterpret_cast<uint64_t*>(src),
                                    static_cast<int>(in_bytes[c][r] / sizeof(uint64_t)));
          while (!shm.control().TestBitAnd()) std::this_thread::yield();
        } else {
          shm.exchange().Alltoall(src, dst, call.ints);
        }
        if (at[c][r] >= 0) std::memcpy(out[c][r], dst, out_bytes[c][r]);
      }
      if (r == 0) {
        direct = shm.stats().direct_exchanges;
        pushed = shm.stats().push_exchanges;
      }
      root_writes += shm.stats().root_writes;
    });
  }
  for (auto& th : threads) th.join();
  return {direct, pushed, root_writes.load()};
}

// Runs ShmControlComm (over a LocalComm) in one process, one thread per
// rank over plain memory. steps[i] is (-1, payloads): a bit-and of one word
// with payloads[r] from rank r; or (root, [data]): BcastString of data from
// root. Returns, per rank, what each step gave it: a bit-and, every rank's
// payload as BitAndPayload read it (rank 0 only; an empty list elsewhere);
// a broadcast, the string it ended with. Also returns the strings that went
// through shared memory, as rank 0 counted them.
std::pair<std::vector<std::vector<std::vector<py::bytes>>>, int64_t> TestingShmControlComm(
    int size, const std::vector<std::pair<int, std::vector<std::string>>>& steps) {
  for (const auto& [root, data] : steps) {
    const size_t want = root < 0 ? static_cast<size_t>(size) : 1;
    if (root >= size || data.size() != want) {
      throw py::value_error("a step is (-1, one payload per rank) or (root < size, [data])");
    }
    if (root < 0) {
      for (const std::string& p : data) {
        if (static_cast<int64_t>(p.size()) > ShmControl::kMaxPayloadBytes) {
          throw py::value_error("a payload longer than kMaxPayloadBytes");
        }
      }
    }
  }
  std::vector<std::vector<std::vector<std::string>>> got(size);
  int64_t through_shm = 0;
  {
    py::gil_scoped_release release;
    const PlainShmRegions host(size, 4096);
    auto world = std::make_shared<LocalWorld>(size);
    std::vector<std::thread> threads;
    for (int r = 0; r < size; ++r) {
      threads.emplace_back([&, r] {
        ShmHost shm(r, size, host.regions, 4096, host.memory, nullptr);
        ShmControlComm comm(std::make_unique<LocalComm>(world, r), &shm.control(), r, size);
        for (const auto& [root, data] : steps) {
          got[r].emplace_back();
          if (root < 0) {
            uint64_t word = ~uint64_t{0};
            comm.StartBitAndWithPayload(&word, 1, data[r]);
            while (!comm.TestBitAnd()) std::this_thread::yield();
            for (int j = 0; j < size && r == 0; ++j) got[r].back().push_back(comm.BitAndPayload(j));
            continue;
          }
          std::string s = r == root ? data[0] : std::string("unchanged");
          comm.BcastString(&s, root);
          got[r].back().push_back(s);
        }
        if (r == 0) through_shm = shm.stats().strings_broadcast;
      });
    }
    for (auto& th : threads) th.join();
  }
  std::vector<std::vector<std::vector<py::bytes>>> out(size);
  for (int r = 0; r < size; ++r) {
    for (const auto& step : got[r]) {
      out[r].emplace_back();
      for (const std::string& s : step) out[r].back().push_back(py::bytes(s));
    }
  }
  return {out, through_shm};
}

}  // namespace

// One host of `size` ranks, one thread each, over plain memory: rank
// `stopper` marks itself stopped (MarkStopped) without making the call,
// and every other rank makes one call of `kind` (allreduce, broadcast from
// the stopper, bitand, string from the stopper). Returns, per rank, what
// ShmPeerGone said, or "" if its call returned (the stopper's is "").
std::vector<std::string> TestingShmPeerStops(int size, int stopper, const std::string& kind) {
  if (size < 2 || stopper < 0 || stopper >= size) throw py::value_error("bad size or stopper");
  if (kind != "allreduce" && kind != "broadcast" && kind != "bitand" && kind != "string") {
    throw py::value_error("unknown kind " + kind);
  }
  py::gil_scoped_release release;
  PlainShmRegions memory(size, 4096);
  std::vector<std::string> said(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      ShmHost shm(r, size, memory.regions, 4096, memory.memory);
      if (r == stopper) {
        shm.MarkStopped();
        return;
      }
      std::vector<float> data(1000, 1.0f);
      uint64_t words[1] = {~uint64_t{0}};
      std::string text;
      try {
        if (kind == "allreduce") {
          shm.allreduce().Allreduce(data.data(), static_cast<int64_t>(data.size()),
                                    DataType::kFloat32, ReduceOp::kSum);
        } else if (kind == "broadcast") {
          shm.exchange().Broadcast(data.data(), data.data(), 4000, stopper);
        } else if (kind == "bitand") {
          shm.control().StartBitAnd(words, 1);
          while (!shm.control().TestBitAnd()) std::this_thread::yield();
        } else {
          shm.control().BcastString(&text, stopper);
        }
      } catch (const ShmPeerGone& gone) {
        said[r] = gone.what();
      }
    });
  }
  for (auto& th : threads) th.join();
  return said;
}

void DefineTestingShmBindings(py::module_& m) {
  m.def("shm_peer_stops", &TestingShmPeerStops, py::arg("size"), py::arg("stopper"),
        py::arg("kind"));
  m.def("shm_control_comm", &TestingShmControlComm, py::arg("size"), py::arg("steps"));
  m.attr("SHM_MAX_PAYLOAD_BYTES") = ShmControl::kMaxPayloadBytes;
  m.def(
      "shm_allreduce",
      [](std::vector<std::vector<std::vector<py::array>>> calls, int dtype, int op,
         int64_t chunk_bytes, int hosts, double prescale, double postscale,
         std::vector<std::vector<std::vector<py::array>>> outputs, int stores) {
        return TestingShmAllreduce(std::move(calls), dtype, op, chunk_bytes, hosts,
                                   Scale{prescale, postscale}, std::move(outputs), stores);
      },
      py::arg("calls"), py::arg("dtype"), py::arg("op"), py::arg("chunk_bytes"), py::kw_only(),
      py::arg("hosts") = 1, py::arg("prescale") = 1.0, py::arg("postscale") = 1.0,
      py::arg("outputs") = std::vector<std::vector<std::vector<py::array>>>{},
      py::arg("stores") = 0);
  m.def("shm_sequence", &TestingShmSequence, py::arg("calls"), py::arg("chunk_bytes"),
        py::arg("direct_min_bytes") = -1, py::arg("stores") = 0,
        py::arg("push") = std::vector<bool>{});
  m.def("stage_store_chooser", &TestingStageStoreChooser, py::arg("stores"), py::arg("calls"));
  m.def("streaming_copy", &TestingStreamingCopy, py::arg("dst"), py::arg("src"));
  m.def("shm_slice_start", &ShmSliceStart);
  m.def("collapse_huge_pages", &TestingCollapseHugePages, py::arg("arrays"));
}

}  // namespace hvdmx
