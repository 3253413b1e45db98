// See scale_harness.h.
#include "bench/scale_harness.h"

#include <time.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <thread>
#include <utility>

#include "algorithms/ring.h"
#include "base/crypto.h"
#include "bench/threads.h"
#include "comm/tcp_comm.h"
#include "config/env_config.h"
#include "negotiation/controller.h"
#include "shm/host_tree_comm.h"
#include "shm/plain_regions.h"
#include "shm/shm_host.h"

namespace hvdmx {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

double ThreadCpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

void Check(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("hvdmx.bench scale: " + what);
}

// What one rank builds: its host's shared memory (with the ring between
// hosts for its local rank when there are steps) and its negotiation comm.
struct ThreadRank {
  std::unique_ptr<ShmHost> shm;
  std::unique_ptr<ControlComm> control;
  const P2PComm* network = nullptr;  // the part of `control` on the network, if any
};

// The element every rank's step data holds at i: small integers, so that
// sums are exact in float32 at any rank count here.
float StepValue(int rank, int64_t i) { return static_cast<float>((rank * 7 + i * 13) % 5); }

}  // namespace

ScaleResult RunScale(const ScaleOptions& o) {
  Check(o.ranks >= 1 && o.ranks <= 4096, "--ranks must be 1..4096, got " + std::to_string(o.ranks));
  Check(o.per_host >= 1 && o.ranks % o.per_host == 0, "--per-host must divide --ranks (" +
                                                          std::to_string(o.ranks) + "), got " +
                                                          std::to_string(o.per_host));
  Check(o.rounds >= 1 && o.requests >= 1 && o.steps >= 1,
        "--rounds, the requests and --steps must be at least 1");
  const int n = o.ranks;
  const int per_host = o.per_host;
  const int hosts = n / per_host;
  const int64_t chunk_bytes = Config().shm_chunk_bytes;
  const bool stepping = !o.step_counts.empty();
  int64_t step_elements = 0;
  for (int64_t c : o.step_counts) step_elements += c;

  std::vector<std::unique_ptr<PlainShmRegions>> memory;
  for (int h = 0; h < hosts; ++h) {
    memory.push_back(std::make_unique<PlainShmRegions>(per_host, chunk_bytes));
  }
  TcpOptions tcp;
  tcp.iface = "lo";
  tcp.key = RandomBytes(kSecretKeyBytes);
  tcp.give_up_seconds = o.give_up_seconds;
  tcp.spin_micros = 0;  // more ranks than cores: never spin
  // The negotiation's network: the hosts' leaders, or every rank.
  ThreadExchange negotiation_exchange(o.host_tree ? hosts : n);
  // The rings between hosts, one per local rank.
  std::vector<std::unique_ptr<ThreadExchange>> ring_exchanges;
  for (int l = 0; l < per_host && stepping && hosts > 1; ++l) {
    ring_exchanges.push_back(std::make_unique<ThreadExchange>(hosts));
  }
  ThreadBarrier barrier(n, std::chrono::seconds(o.give_up_seconds));
  ScaleResult result;
  result.ranks.resize(n);
  std::vector<double> starts(4), ends(4);  // rank 0's clock at the phases' barriers
  bool step_wrong = false;
  std::mutex step_mu;

  auto body = [&](int r) {
    const int h = r / per_host, l = r % per_host;
    ThreadRank me;
    ShmAllreduce::CrossAllreduce cross;
    if (!ring_exchanges.empty()) {
      // Linked as the job links its ring between hosts (job/shm_wiring.cc).
      TcpOptions ring_options = tcp;
      ring_options.peers = P2PComm::DataPeers(h, hosts);
      ThreadExchange* exchange = ring_exchanges[l].get();
      std::shared_ptr<TcpComm> ring = std::make_shared<TcpComm>(
          h, hosts, ring_options, [=](const std::string& mine) { return (*exchange)(h, mine); });
      auto scratch = std::make_shared<RingScratch>();
      const int64_t segment_bytes = Config().ring_segment_bytes;
      cross = [ring, scratch, segment_bytes](void* buf, float* wide, int64_t count, DataType dtype,
                                             ReduceOp op, double postscale) {
        RingCrossAllreduce(*ring, buf, wide, count, dtype, op, postscale, false, segment_bytes,
                           scratch.get());
      };
    }
    me.shm = std::make_unique<ShmHost>(l, per_host, memory[h]->regions, chunk_bytes,
                                       memory[h]->memory, std::move(cross));
    if (o.host_tree) {
      std::unique_ptr<P2PComm> leaders;
      if (l == 0) {
        TcpOptions options = tcp;
        options.peers = P2PComm::NegotiationPeers(h, hosts, options.direct_bit_and_ranks);
        leaders = std::make_unique<TcpComm>(h, hosts, options, [&, h](const std::string& mine) {
          return negotiation_exchange(h, mine);
        });
      }
      me.network = leaders.get();
      me.control =
          std::make_unique<HostTreeComm>(&me.shm->control(), l, per_host, std::move(leaders), r, n);
    } else {
      TcpOptions options = tcp;
      options.peers = P2PComm::NegotiationPeers(r, n, options.direct_bit_and_ranks);
      auto flat = std::make_unique<TcpComm>(
          r, n, options, [&, r](const std::string& mine) { return negotiation_exchange(r, mine); });
      me.network = flat.get();
      me.control = std::move(flat);
    }
    ControlComm& control = *me.control;
    // Waits as the runtime's do (Runtime::Idle): a leader blocks in
    // poll(2) on its sockets; a wait in shared memory polls, sleeping
    // longer the longer it has waited, up to 1 ms.
    Clock::time_point wait_start;
    auto idle = [&control, &wait_start](int64_t i) {
      if (i == 0) wait_start = Clock::now();
      if (control.WakesOnArrival()) {
        control.AwaitArrival(int64_t{1} << 40);
      } else if (i < 20) {
        std::this_thread::yield();
      } else {
        const double waited_us = 1e6 * Seconds(wait_start, Clock::now());
        std::this_thread::sleep_for(std::chrono::microseconds(
            std::min<int64_t>(1000, 20 + static_cast<int64_t>(waited_us / 8))));
      }
      return true;
    };
    control.set_idle(idle);
    Controller controller(control, /*cache_capacity=*/1024);
    std::vector<Request> requests(o.requests);
    for (int t = 0; t < o.requests; ++t) {
      Request& q = requests[t];
      q.rank = r;
      q.name = "gradient." + std::to_string(t);
      q.dtypes = {DataType::kFloat32};
      const int64_t count = stepping ? o.step_counts[t % o.step_counts.size()] : 1 + t % 1000;
      q.shapes = {{count}};
    }
    // One step's negotiation: every request submitted, rounds until all ran.
    auto negotiate = [&] {
      size_t answered = 0;
      std::vector<Request> fresh = requests;
      while (answered < requests.size()) {
        RoundResult round = controller.RunRound(std::move(fresh), false, {}, idle);
        fresh.clear();
        if (round.abandoned) throw std::runtime_error("a negotiation round was abandoned");
        for (const Response& response : round.responses) {
          if (!response.error.empty()) throw std::runtime_error(response.error);
        }
        answered += round.responses.size();
      }
    };
    auto mark = [&](int phase, bool end) {
      barrier.Wait();
      if (r == 0) (end ? ends : starts)[phase] = Seconds(Clock::time_point(), Clock::now());
    };
    mark(0, false);
    negotiate();  // uncached: every request goes to rank 0
    mark(0, true);
    for (int i = 0; i < 3; ++i) negotiate();  // warm up the cached path
    const Traffic before = me.network ? me.network->traffic() : Traffic();
    const double cpu_before = ThreadCpuSeconds();
    mark(1, false);
    for (int i = 0; i < o.rounds; ++i) negotiate();
    mark(1, true);
    const double cpu = ThreadCpuSeconds() - cpu_before;
    const Traffic after = me.network ? me.network->traffic() : Traffic();
    ScaleRank& mine = result.ranks[r];
    mine.sent_messages = double(after.sent_messages - before.sent_messages) / o.rounds;
    mine.received_messages = double(after.received_messages - before.received_messages) / o.rounds;
    mine.sent_bytes = double(after.sent_bytes - before.sent_bytes) / o.rounds;
    mine.received_bytes = double(after.received_bytes - before.received_bytes) / o.rounds;
    mine.cpu_seconds = cpu / o.rounds;
    if (const auto* tree = dynamic_cast<const HostTreeComm*>(me.control.get())) {
      mine.hops = tree->last_bit_and_hops();
    } else {
      mine.hops = dynamic_cast<const P2PComm&>(*me.control).last_bit_and_hops();
    }
    if (const auto* tcp_comm = dynamic_cast<const TcpComm*>(me.network)) {
      mine.links = tcp_comm->connections();
    }
    if (!stepping) return;
    std::vector<float> data(static_cast<size_t>(step_elements));
    const int64_t piece = std::max<int64_t>(1, o.fusion_bytes / 4);
    for (int s = 0; s <= o.steps; ++s) {  // step 0 is a warm-up
      for (int64_t i = 0; i < step_elements; ++i) data[i] = StepValue(r, i);
      if (s == 1) mark(2, false);
      negotiate();
      for (int64_t at = 0; at < step_elements; at += piece) {
        me.shm->allreduce().Allreduce(data.data() + at, std::min(piece, step_elements - at),
                                      DataType::kFloat32, ReduceOp::kSum);
      }
    }
    mark(2, true);
    for (int64_t i = 0; i < step_elements; i += 4099) {
      float want = 0;
      for (int j = 0; j < n; ++j) want += StepValue(j, i);
      if (data[i] != want) {
        std::lock_guard<std::mutex> lock(step_mu);
        step_wrong = true;
      }
    }
  };

  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (const std::exception& e) {
        result.ranks[r].error = e.what();
        barrier.Abort();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  result.uncached_seconds = ends[0] - starts[0];
  result.round_seconds = (ends[1] - starts[1]) / o.rounds;
  if (stepping) {
    result.step_seconds = (ends[2] - starts[2]) / o.steps;
    result.step_correct = !step_wrong;
  }
  return result;
}

}  // namespace hvdmx
