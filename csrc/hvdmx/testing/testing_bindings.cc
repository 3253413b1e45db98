// Entry points for the test suite (_hvdmx_testing): the kernels,
// the ring and the autotuner driven in one process, with threads as ranks
// over plain memory or LocalComm, and whole runtimes over LocalComm
// (LocalJob); the shared-memory collectives' are in testing_shm_bindings.cc.
// Nothing here is used by hvdmx itself.
#include "testing/testing_bindings.h"

#include <sys/wait.h>
#include <unistd.h>

#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "algorithms/reduce_kernels.h"
#include "algorithms/ring.h"
#include "comm/local_comm.h"
#include "config/env_config.h"
#include "platform/cpu_binding.h"
#include "platform/output_pool.h"
#include "runtime/autotune.h"
#include "runtime/fusion_plan.h"
#include "runtime/runtime.h"
#include "shm/shm_control_comm.h"

namespace py = pybind11;

namespace hvdmx {

DataType CheckedType(int code) {
  if (!IsSupportedDataType(code)) throw py::value_error("unsupported dtype code");
  return static_cast<DataType>(code);
}

namespace {

void TestingReduceInto(py::array dst, py::array src, int dtype, int op, bool scalar) {
  DataType t = CheckedType(dtype);
  const int64_t count = dst.nbytes() / static_cast<int64_t>(DataTypeSize(t));
  if (src.nbytes() != dst.nbytes()) throw py::value_error("dst and src differ in size");
  void* d = dst.mutable_data();
  const void* s = src.data();
  if (scalar) {
    // The portable path one element at a time: no vector body at all.
    const int64_t size = static_cast<int64_t>(DataTypeSize(t));
    for (int64_t i = 0; i < count; ++i) {
      ReduceIntoOn(KernelPath::kPortable, static_cast<char*>(d) + i * size,
                   static_cast<const char*>(s) + i * size, 1, t, static_cast<ReduceOp>(op));
    }
  } else {
    ReduceInto(d, s, count, t, static_cast<ReduceOp>(op));
  }
}

void TestingReduce3Scaled(py::array out, py::array a, py::array b, int dtype, int op,
                          double factor) {
  DataType t = CheckedType(dtype);
  if (a.nbytes() != out.nbytes() || b.nbytes() != out.nbytes()) {
    throw py::value_error("out, a and b differ in size");
  }
  Reduce3Scaled(out.mutable_data(), a.data(), b.data(),
                out.nbytes() / static_cast<int64_t>(DataTypeSize(t)), t, static_cast<ReduceOp>(op),
                factor);
}

void TestingScale(py::array buf, int dtype, double factor) {
  DataType t = CheckedType(dtype);
  ScaleBuffer(buf.mutable_data(), buf.nbytes() / static_cast<int64_t>(DataTypeSize(t)), t, factor);
}

// Runs body(comm, r) on one thread per rank of an in-process world of n
// ranks (LocalComm), and returns once every rank's body has.
template <typename F>
void OnLocalRanks(int n, F body) {
  auto world = std::make_shared<LocalWorld>(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      LocalComm comm(world, r);
      body(comm, r);
    });
  }
  for (auto& th : threads) th.join();
}

// One widened kernel (reduce_kernels.h: 0 widen, 1 reduce, 2 narrow) over
// `count` elements of a half dtype; the float32 side is a float32 array.
void TestingWidenedKernel(int kernel, py::array out, py::array in, int dtype, int op, double factor,
                          bool portable) {
  DataType t = CheckedType(dtype);
  if (!HalfReducesWide(t)) throw py::value_error("not a half dtype");
  const py::array& half = kernel == 2 ? out : in;
  const py::array& wide = kernel == 2 ? in : out;
  const int64_t count = half.nbytes() / 2;
  if (wide.nbytes() != count * 4) throw py::value_error("the float32 side differs in size");
  const KernelPath path = portable ? KernelPath::kPortable : KernelPath::kNative;
  switch (kernel) {
    case 0:
      WidenScaledOn(path, static_cast<float*>(out.mutable_data()), in.data(), count, t, factor);
      return;
    case 1:
      ReduceWidenedIntoOn(path, static_cast<float*>(out.mutable_data()), in.data(), count, t,
                          static_cast<ReduceOp>(op), factor);
      return;
    case 2:
      NarrowScaledOn(path, out.mutable_data(), static_cast<const float*>(in.data()), count, t,
                     factor);
      return;
  }
  throw py::value_error("kernel must be 0 (widen), 1 (reduce) or 2 (narrow), not " +
                        std::to_string(kernel));
}

// Runs RingAllreduceWidened on LocalComm, one thread per array (= rank), in
// place, the operands read from the half arrays.
void TestingRingAllreduceWidened(std::vector<py::array> arrays, int dtype, int op,
                                 int64_t segment_bytes, Scale scale) {
  DataType t = CheckedType(dtype);
  if (!HalfReducesWide(t)) throw py::value_error("not a half dtype");
  const int n = static_cast<int>(arrays.size());
  std::vector<void*> data;
  std::vector<int64_t> counts;
  for (auto& a : arrays) {
    data.push_back(a.mutable_data());
    counts.push_back(a.nbytes() / 2);
  }
  py::gil_scoped_release release;
  OnLocalRanks(n, [&](LocalComm& comm, int r) {
    RingScratch scratch;
    std::vector<float> wide(counts[r]);
    RingAllreduceWidened(comm, data[r], wide.data(), /*operands_in_wide=*/false, counts[r], t,
                         static_cast<ReduceOp>(op), scale, segment_bytes, &scratch);
  });
}

// Runs RingAllreduce on LocalComm, one thread per array (= rank), in place.
void TestingRingAllreduce(std::vector<py::array> arrays, int dtype, int op, int64_t segment_bytes) {
  DataType t = CheckedType(dtype);
  const int n = static_cast<int>(arrays.size());
  std::vector<void*> data;
  std::vector<int64_t> counts;
  for (auto& a : arrays) {
    data.push_back(a.mutable_data());
    counts.push_back(a.nbytes() / static_cast<int64_t>(DataTypeSize(t)));
  }
  py::gil_scoped_release release;
  OnLocalRanks(n, [&](LocalComm& comm, int r) {
    RingScratch scratch;
    RingAllreduce(comm, data[r], counts[r], t, static_cast<ReduceOp>(op), segment_bytes, &scratch);
  });
}

// An EnvLookup over a map, for tests that pass their own environment.
EnvLookup MapLookup(const std::map<std::string, std::string>& env) {
  return [env](const std::string& name) -> std::optional<std::string> {
    auto it = env.find(name);
    if (it == env.end()) return std::nullopt;
    return it->second;
  };
}

py::dict TestingLoadConfig(const std::map<std::string, std::string>& env) {
  Config c;
  ThrowIfError(LoadConfig(MapLookup(env), &c));
  py::dict d;
  d["fusion_threshold"] = c.fusion_threshold;
  d["fusion_max_tensor_bytes"] = c.fusion_max_tensor_bytes;
  d["fusion_piece_bytes"] = c.fusion_piece_bytes;
  d["output_pool_bytes"] = c.output_pool_bytes;
  d["cycle_time_ms"] = c.cycle_time_ms;
  d["cache_capacity"] = c.cache_capacity;
  d["allreduce_algo"] = AllreduceAlgoName(c.allreduce_algo);
  d["ring_min_bytes"] = c.ring_min_bytes;
  d["ring_segment_bytes"] = c.ring_segment_bytes;
  d["shm_min_bytes"] = c.shm_min_bytes;
  d["round_allreduce_bytes"] = c.round_allreduce_bytes;
  d["shm_chunk_bytes"] = c.shm_chunk_bytes;
  d["shm_direct_min_bytes"] = DirectMinBytesValue(c.shm_direct_min_bytes);
  d["shm_streaming_stores"] = StageStoresName(c.shm_streaming_stores);
  d["hierarchical_allreduce"] = c.hierarchical_allreduce;
  d["huge_pages"] = c.huge_pages;
  d["shm_push"] = c.shm_push;
  d["adasum_hierarchical"] = c.adasum_hierarchical;
  d["half_partials"] = c.half_partials_wide ? "float32" : "half";
  d["cpu_bind"] = CpuBindName(c.cpu_bind);
  d["testing_ranks_per_host"] = c.testing_ranks_per_host;
  d["log_level"] = static_cast<int>(c.log_level);
  d["stall_check_seconds"] = c.stall_check_seconds;
  d["stall_shutdown_seconds"] = c.stall_shutdown_seconds;
  d["timeline"] = c.timeline_path;
  d["timeline_mark_cycles"] = c.timeline_mark_cycles;
  d["autotune"] = c.autotune;
  d["autotune_log"] = c.autotune_log;
  d["fusion_threshold_fixed"] = c.fusion_threshold_fixed;
  d["cycle_time_fixed"] = c.cycle_time_fixed;
  d["allreduce_algo_fixed"] = c.allreduce_algo_fixed;
  return d;
}

// The fusion groups of a round of allreduce responses, each given as
// (dtype code, element counts of its tensors): lists of (response, tensor).
std::vector<std::vector<std::pair<int, int>>> TestingPlanFusion(
    const std::vector<std::pair<int, std::vector<int64_t>>>& responses, int64_t threshold,
    int64_t max_tensor_bytes) {
  std::vector<Response> round;
  for (const auto& spec : responses) {
    Response r;
    r.type = CollectiveType::kAllreduce;
    r.name = "t" + std::to_string(round.size());
    r.counts = spec.second;
    r.dtypes.assign(spec.second.size(), CheckedType(spec.first));
    round.push_back(std::move(r));
  }
  std::vector<std::vector<std::pair<int, int>>> out;
  for (const FusionGroup& group : PlanFusion(round, threshold, max_tensor_bytes)) {
    out.emplace_back();
    for (const FusionGroup::Item& item : group.items) {
      out.back().emplace_back(item.response, item.tensor);
    }
  }
  return out;
}

// Drives rank 0's Autotuner on a simulated clock: under the configuration
// `env` (as HVDMX_* variables), each round lasts 10 ms and moves
// throughput(fusion_threshold, cycle_time_ms, algorithm name) * 10 ms bytes
// under the setting the tuner wants at that moment. Returns the settings
// tried in order (the warm-up first) as (threshold, cycle, algorithm)
// tuples, the setting chosen, and the simulated seconds until the choice;
// chosen is None if none was made within an hour.
py::dict TestingAutotune(const std::map<std::string, std::string>& env, py::function throughput) {
  Config config;
  ThrowIfError(LoadConfig(MapLookup(env), &config));
  Autotuner tuner(config, /*leader=*/true);
  constexpr double kRoundSeconds = 0.01;
  auto now = Autotuner::Clock::time_point{};
  py::list tried;
  double seconds = 0;
  auto as_tuple = [](const TunedSetting& s) {
    return py::make_tuple(s.fusion_threshold, s.cycle_time_ms, AllreduceAlgoName(s.algo));
  };
  py::object last = py::none();
  for (; !tuner.done() && seconds < 3600; seconds += kRoundSeconds) {
    const TunedSetting s = tuner.current();
    py::tuple now_tuple = as_tuple(s);
    if (!now_tuple.equal(last)) {
      tried.append(now_tuple);
      last = now_tuple;
    }
    const double rate =
        throughput(s.fusion_threshold, s.cycle_time_ms, AllreduceAlgoName(s.algo)).cast<double>();
    now += std::chrono::duration_cast<Autotuner::Clock::duration>(
        std::chrono::duration<double>(kRoundSeconds));
    tuner.RoundDone(std::max<int64_t>(1, static_cast<int64_t>(rate * kRoundSeconds)), now);
  }
  py::dict d;
  d["tried"] = tried;
  d["seconds"] = seconds;
  d["chosen"] = tuner.done() ? py::object(as_tuple(tuner.current())) : py::object(py::none());
  return d;
}

// The control comm of a LocalJob's rank that breaks the protocol: the first
// bit-and message it sends rank 0 with requests (a payload, Note [Requests
// with the bit-and] in negotiation/controller.h) carries `lie` in their
// place. `bit_words`: the words of the job's bit-ands.
class LyingLocalComm : public LocalComm {
 public:
  LyingLocalComm(std::shared_ptr<LocalWorld> world, int rank, int bit_words, std::string lie)
      : LocalComm(std::move(world), rank), bit_words_(bit_words), lie_(std::move(lie)) {}

  Request ISend(const void* buf, int64_t bytes, int peer) override {
    // A direct bit-and's message: its words, its partial's length and the
    // partial, then the payload.
    const size_t header = static_cast<size_t>(bit_words_) * 8 + 8;
    if (lied_ || peer != 0 || static_cast<size_t>(bytes) <= header) {
      return LocalComm::ISend(buf, bytes, peer);
    }
    std::string message(static_cast<const char*>(buf), static_cast<size_t>(bytes));
    uint64_t partial = 0;
    std::memcpy(&partial, message.data() + header - 8, 8);
    if (partial >= message.size() - header) return LocalComm::ISend(buf, bytes, peer);
    message.resize(header + static_cast<size_t>(partial));
    message += lie_;
    lied_ = true;
    return LocalComm::ISend(message.data(), static_cast<int64_t>(message.size()), peer);
  }

 private:
  int bit_words_;
  std::string lie_;
  bool lied_ = false;
};

// A whole job in one process: `size` runtimes over LocalComm, for testing
// negotiation, the cache and fusion without MPI. With `shm`, the ranks also
// share a ShmHost over plain memory, as ranks on one host do, so the
// control comm is a ShmControlComm (shm_control_comm.h) and allreduces go
// through shared memory. Rank `liar` (-1: none) sends rank 0 `lie` in place
// of its first requests (LyingLocalComm; without `shm`, up to 4 ranks).
// Arrays passed to submit must stay alive until wait() has returned for
// that ticket.
class LocalJob {
 public:
  LocalJob(int size, const std::map<std::string, std::string>& env, bool shm, int liar,
           const std::string& lie) {
    Config config;
    ThrowIfError(LoadConfig(MapLookup(env), &config));
    auto control = std::make_shared<LocalWorld>(size);
    data_ = std::make_shared<LocalWorld>(size);
    const PlainShmRegions host(shm ? size : 0, config.shm_chunk_bytes);
    for (int r = 0; r < size; ++r) {
      std::unique_ptr<ShmHost> local;
      if (shm) {
        local =
            std::make_unique<ShmHost>(r, size, host.regions, config.shm_chunk_bytes, host.memory);
      }
      std::unique_ptr<ControlComm> comm =
          r == liar ? std::make_unique<LyingLocalComm>(
                          control, r, Controller::BitWords(config.cache_capacity), lie)
                    : std::make_unique<LocalComm>(control, r);
      // As the job wires ranks that share one host (job/comm_wiring.h).
      comm = ControlThroughShm(std::move(comm), local.get(),
                               Controller::BitWords(config.cache_capacity));
      runtimes_.push_back(std::make_unique<Runtime>(
          std::move(comm), std::make_unique<LocalComm>(data_, r), config, std::move(local),
          HostMap(std::vector<int64_t>(static_cast<size_t>(size), 0)), false));
      runtimes_.back()->Start();
    }
  }
  // Per rank: the Controller's sent_with_bit_and(), gathered() and
  // reduced_in_round().
  std::vector<std::tuple<int64_t, int64_t, int64_t>> Negotiation() const {
    std::vector<std::tuple<int64_t, int64_t, int64_t>> out;
    for (const auto& rt : runtimes_) {
      const Controller& c = rt->controller();
      out.emplace_back(c.sent_with_bit_and(), c.gathered(), c.reduced_in_round());
    }
    return out;
  }
  ~LocalJob() { Shutdown(); }

  int64_t Submit(int rank, const std::string& kind, const std::string& name,
                 std::vector<py::array> inputs, std::vector<py::array> outputs, int dtype, int op,
                 int root, Scale scale) {
    Runtime& rt = *runtimes_.at(rank);
    TensorEntry entry;
    CollectiveArgs call;
    call.type = kind == "broadcast" ? CollectiveType::kBroadcast : CollectiveType::kAllreduce;
    call.name = name;
    call.op = op;
    call.root = root;
    call.scale = scale;
    for (size_t i = 0; i < inputs.size(); ++i) {
      call.dtypes.push_back(dtype);
      call.shapes.emplace_back(inputs[i].shape(), inputs[i].shape() + inputs[i].ndim());
      entry.inputs.push_back(inputs[i].data());
      entry.outputs.push_back(outputs[i].mutable_data());
    }
    entry.request = MakeRequest(call, rank);
    const int64_t ticket = next_ticket_++;
    entry.callback = [this, ticket, &rt](const Status& status) {
      // What the runtime says of its stop while the callback fires: what a
      // rank that reads the failed output finds (Runtime::Stop).
      const Status::Code stop = rt.stop_status().code();
      std::lock_guard<std::mutex> lock(mu_);
      done_[ticket] = status.ok() ? std::string() : "E:" + status.message();
      stop_at_callback_[ticket] = static_cast<int>(stop);
      cv_.notify_all();
    };
    ThrowIfError(rt.Enqueue(std::move(entry)));
    return ticket;
  }

  // Returns None on success, the error message otherwise.
  py::object Wait(int64_t ticket, double timeout_s) {
    std::string result;
    {
      py::gil_scoped_release release;
      std::unique_lock<std::mutex> lock(mu_);
      if (!cv_.wait_for(lock, std::chrono::duration<double>(timeout_s),
                        [&] { return done_.count(ticket) > 0; })) {
        result = "T";
      } else {
        result = done_[ticket];
        done_.erase(ticket);
      }
    }
    if (result == "T") throw std::runtime_error("LocalJob.wait timed out");
    if (result.empty()) return py::none();
    return py::str(result.substr(2));
  }

  // The code of the runtime's stop status when the ticket's callback fired
  // (call after wait() has returned for it).
  int StopAtCallback(int64_t ticket) {
    std::lock_guard<std::mutex> lock(mu_);
    return stop_at_callback_.at(ticket);
  }

  // Every rank's data transfers that wait for a message from now on fail
  // as if the peer's process had ended (LocalWorld::Cut).
  void CutData(const std::string& why) { data_->Cut(why); }

  void Shutdown() {
    py::gil_scoped_release release;
    std::vector<std::thread> threads;
    for (auto& rt : runtimes_) threads.emplace_back([&rt] { rt->Shutdown(); });
    for (auto& th : threads) th.join();
  }

 private:
  std::vector<std::unique_ptr<Runtime>> runtimes_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<int64_t, std::string> done_;
  std::map<int64_t, int> stop_at_callback_;
  std::shared_ptr<LocalWorld> data_;  // the ranks' data comms' world
  int64_t next_ticket_ = 0;
};

// Takes a block of `bytes` from the process's output pool (the one
// hvdmx._core's arrays come from: one core library) and fills it, then forks;
// the child gives the block back and trims the pool to nothing, as a
// forked child that drops its copy of the parent's array may, and exits.
// Returns whether the block lies in the shared output file, and whether it
// still holds its bytes here once the child is gone.
std::pair<bool, bool> TestingOutputPoolForkedChildDrops(int64_t bytes) {
  OutputPool& pool = OutputPool::Get();
  char* block = static_cast<char*>(pool.Take(bytes));
  if (block == nullptr) throw py::value_error("the output pool is off");
  std::memset(block, 0x5a, static_cast<size_t>(bytes));
  int64_t offset = 0;
  const bool shared = pool.InArena(block, bytes, &offset);
  const pid_t child = fork();
  if (child < 0) throw py::value_error("fork failed");
  if (child == 0) {
    pool.Give(block, bytes);
    pool.SetLimit(0);
    _exit(0);
  }
  int status = 0;
  waitpid(child, &status, 0);
  bool intact = true;
  for (int64_t i = 0; i < bytes; ++i) intact = intact && block[i] == 0x5a;
  pool.Give(block, bytes);
  return {shared, intact};
}

}  // namespace

void DefineTestingBindings(py::module_& m) {
  m.def("output_pool_class", &OutputPool::ClassBytes);
  m.def("output_pool_forked_child_drops", &TestingOutputPoolForkedChildDrops, py::arg("bytes"));
  // A block of the process's output pool, taken and given back by address:
  // what _core.stats() reports of it shows whose pool it is.
  m.def("output_pool_take",
        [](int64_t bytes) { return reinterpret_cast<uintptr_t>(OutputPool::Get().Take(bytes)); });
  m.def("output_pool_give", [](uintptr_t block, int64_t bytes) {
    OutputPool::Get().Give(reinterpret_cast<void*>(block), bytes);
  });
  m.def("reduce_into", &TestingReduceInto);
  m.def("scale", &TestingScale);
  m.def("reduce3_scaled", &TestingReduce3Scaled);
  m.def("ring_allreduce", &TestingRingAllreduce);
  m.def("widened_kernel", &TestingWidenedKernel);
  m.def(
      "ring_allreduce_widened",
      [](std::vector<py::array> arrays, int dtype, int op, int64_t segment_bytes, double prescale,
         double postscale) {
        TestingRingAllreduceWidened(std::move(arrays), dtype, op, segment_bytes,
                                    Scale{prescale, postscale});
      },
      py::arg("arrays"), py::arg("dtype"), py::arg("op"), py::arg("segment_bytes"), py::kw_only(),
      py::arg("prescale") = 1.0, py::arg("postscale") = 1.0);
  m.def("load_config", &TestingLoadConfig);
  m.def("choose_cpu", [](const std::string& mode, const std::vector<int>& cpus, int local_rank,
                         int local_size, bool same_cpus_on_host) {
    const std::map<std::string, std::string> env = {{"HVDMX_CPU_BIND", mode}};
    Config c;
    ThrowIfError(LoadConfig(MapLookup(env), &c));
    return ChooseCpu(c.cpu_bind, cpus, local_rank, local_size, same_cpus_on_host);
  });
  m.def("autotune", &TestingAutotune);
  m.def("plan_fusion", &TestingPlanFusion);
  DefineTestingShmBindings(m);
  DefineTestingTcpBindings(m);
  DefineTestingCommBindings(m);
  DefineTestingNegotiationBindings(m);
  DefineTestingLiarBindings(m);
  py::class_<LocalJob>(m, "LocalJob")
      .def(py::init([](int size, const std::map<std::string, std::string>& env, bool shm, int liar,
                       const py::bytes& lie) {
             return std::make_unique<LocalJob>(size, env, shm, liar, std::string(lie));
           }),
           py::arg("size"), py::arg("env"), py::arg("shm") = false, py::arg("liar") = -1,
           py::arg("lie") = py::bytes())
      .def("negotiation", &LocalJob::Negotiation)
      .def("cut_data", &LocalJob::CutData, py::arg("why"))
      .def("stop_at_callback", &LocalJob::StopAtCallback, py::arg("ticket"))
      .def(
          "submit",
          [](LocalJob& job, int rank, const std::string& kind, const std::string& name,
             std::vector<py::array> inputs, std::vector<py::array> outputs, int dtype, int op,
             int root, double prescale, double postscale) {
            return job.Submit(rank, kind, name, std::move(inputs), std::move(outputs), dtype, op,
                              root, Scale{prescale, postscale});
          },
          py::kw_only(), py::arg("rank"), py::arg("kind"), py::arg("name"), py::arg("inputs"),
          py::arg("outputs"), py::arg("dtype"), py::arg("op"), py::arg("root") = 0,
          py::arg("prescale") = 1.0, py::arg("postscale") = 1.0)
      .def("wait", &LocalJob::Wait)
      .def("shutdown", &LocalJob::Shutdown);
}

}  // namespace hvdmx
