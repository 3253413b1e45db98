#include "runtime/runtime.h"

#include <algorithm>
#include <climits>
#include <set>
#include <sstream>

#include <pthread.h>
#include <sys/prctl.h>

#include "base/logging.h"
#include "base/timeline.h"

namespace hvdmx {
namespace {

Status ShutdownStatus() {
  return Status::Shutdown(
      "hvdmx has been shut down (hvd.shutdown() ran on this or another rank) before this "
      "collective could run; call hvd.init() again before submitting collectives");
}

constexpr char kShutDownByPeer[] =
    "hvdmx has been shut down by another rank (it called hvd.shutdown(), or its process "
    "ended, which calls it), which stops hvdmx on every rank; look at the other ranks' "
    "output for why. No collective can run until every rank calls hvd.init() again";

std::string JoinNames(const std::vector<std::string>& names, size_t limit) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < limit; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > limit) out += ", ... (" + std::to_string(names.size()) + " in all)";
  return out;
}

// How long a wait polls before it starts to sleep.
constexpr int64_t kSpinMicros = 100;

}  // namespace

Runtime::Runtime(std::unique_ptr<ControlComm> control, std::unique_ptr<DataComm> data,
                 const Config& config, std::unique_ptr<ShmHost> shm, HostMap hosts,
                 bool peers_on_host)
    : shm_(std::move(shm)),
      control_(std::move(control)),
      data_(std::move(data)),
      config_(config),
      controller_(*control_, config.cache_capacity, config.stall_shutdown_seconds,
                  config.round_allreduce_bytes),
      executor_(*data_, config_, shm_.get(), peers_on_host, std::move(hosts)) {
  controller_.set_input_reader([this](const std::string& name, std::vector<const void*>* inputs) {
    return queue_.Inputs(name, inputs);
  });
  if (config_.stall_shutdown_seconds > 0) {
    // The coordinator's exchanges give up as a round's bit-and does (Note
    // [Background loop]); without a stall shutdown they wait as MPI does.
    control_->set_idle([this](int64_t i) { return Idle(i); });
  }
  if (config_.autotune && control_->rank() == 0) {
    tuner_ = std::make_unique<Autotuner>(config_, /*leader=*/true);
  }
}

Runtime::~Runtime() {
  if (thread_.joinable()) Shutdown();
}

void Runtime::Start() {
  thread_ = std::thread([this] { Loop(); });
  // Named here, not in the thread, so the name is there when Start returns
  // (top, gdb and the tests look for it).
  pthread_setname_np(thread_.native_handle(), "hvdmx-runtime");
}

void Runtime::AddInEngine(int delta) {
  std::lock_guard<std::mutex> lock(in_engine_mu_);
  in_engine_ += delta;
  HVDMX_CHECK(in_engine_ >= 0, "more collectives left the engine than entered it");
  if (in_engine_ == 0) in_engine_cv_.notify_all();
}

bool Runtime::WaitNoneInEngine(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(in_engine_mu_);
  return in_engine_cv_.wait_for(lock, timeout, [this] { return in_engine_ == 0; });
}

bool Runtime::NothingPending() {
  if (!WaitNoneInEngine(std::chrono::milliseconds(0))) return false;
  size_t queued = 0;
  queue_.EnqueuedBefore(std::chrono::steady_clock::time_point::max(), 0, &queued);
  return queued == 0;
}

Status Runtime::Enqueue(TensorEntry entry) {
  if (stopped_) {
    entry.callback(StoppedStatus());
    return Status::Ok();
  }
  bool deferred = false;
  Status added = queue_.Add(std::move(entry), &deferred);
  if (!added.ok()) return added;
  // Until its turn comes it counts as inside the engine, for join(); the
  // background thread takes it off (CountReleased) when it enters
  // negotiation. The push's own count is held until this returns, so the
  // count never drops below zero in between.
  if (deferred) AddInEngine(1);
  if (stopped_) {
    // The loop may have exited between the check above and the Add.
    FailAll(StoppedStatus());
    return Status::Ok();
  }
  {
    // Taking the lock orders this Add before the loop's next look at the
    // queue, so the notification below cannot be lost.
    std::lock_guard<std::mutex> lock(mu_);
  }
  wake_.notify_one();
  return Status::Ok();
}

void Runtime::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutdown_requested_ = true;
  }
  wake_.notify_one();
  if (thread_.joinable()) thread_.join();
  stopped_ = true;
  if (shm_) shm_->MarkStopped();
  FailAll(ShutdownStatus());
}

Status Runtime::StoppedStatus() {
  std::lock_guard<std::mutex> lock(stop_mu_);
  return stop_status_.ok() ? ShutdownStatus() : stop_status_;
}

void Runtime::FailAll(const Status& status) {
  for (TensorEntry& entry : queue_.TakeAll()) entry.callback(status);
  CountReleased();
}

void Runtime::CountReleased() {
  const int64_t released = queue_.TakeReleasedCount();
  if (released > 0) AddInEngine(-static_cast<int>(released));
}

bool Runtime::Idle(int64_t iteration) {
  const auto now = std::chrono::steady_clock::now();
  if (iteration == 0) wait_started_ = now;
  const int64_t waited_us =
      std::chrono::duration_cast<std::chrono::microseconds>(now - wait_started_).count();
  if (control_->WakesOnArrival()) {
    // Blocks until a byte arrives (Note [Waiting for the network] in
    // comm/tcp_comm.h), looking up now and then for the stall checks below.
    control_->AwaitArrival(waited_us);
  } else if (waited_us < kSpinMicros) {
    // Poll without sleeping for a short while: peers usually arrive within
    // microseconds. Then sleep, longer each time, up to 1 ms.
    std::this_thread::yield();
    return true;
  } else {
    std::this_thread::sleep_for(
        std::chrono::microseconds(std::min<int64_t>(1000, 20 + (waited_us - kSpinMicros) / 8)));
  }
  MaybeWarnStall();
  return config_.stall_shutdown_seconds <= 0 ||
         waited_us < static_cast<int64_t>(config_.stall_shutdown_seconds * 1e6);
}

void Runtime::MaybeWarnStall() {
  if (config_.stall_check_seconds <= 0) return;
  const auto now = std::chrono::steady_clock::now();
  if (now < next_stall_check_) return;
  const auto period = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(config_.stall_check_seconds));
  next_stall_check_ =
      now + std::min(period, std::chrono::steady_clock::duration(std::chrono::seconds(1)));
  if (shutdown_wait_started_ != std::chrono::steady_clock::time_point() &&
      now - shutdown_wait_started_ >= period && now >= last_stall_warning_ + period) {
    // Shutdown() waits for a round that every rank takes part in, and an
    // idle rank takes none until it calls hvdmx again or exits.
    last_stall_warning_ = now;
    HVDMX_LOG(kWarning)
        << "hvd.shutdown() on this rank has waited "
        << std::chrono::duration_cast<std::chrono::seconds>(now - shutdown_wait_started_).count()
        << " s for the other ranks. hvdmx stops on every rank at once, in a negotiation round "
           "that each other rank joins when it next submits a collective, calls hvd.shutdown() "
           "or exits; a rank may be busy outside hvdmx (the wait then ends when it gets there) "
           "or stuck. See docs/errors.md.";
    return;
  }
  size_t total = 0;
  const std::vector<std::string> stalled = queue_.EnqueuedBefore(now - period, 8, &total);
  if (stalled.empty() || now < last_stall_warning_ + period) return;
  last_stall_warning_ = now;
  LogLine log(LogLevel::kWarning);
  std::ostringstream& line = log.stream();
  line << total << " collective(s) submitted on this rank over " << config_.stall_check_seconds
       << " s ago have not run, because other ranks have not "
       << "submitted them: " << JoinNames(stalled, 8) << ".";
  if (rank() == 0) {
    const std::vector<std::string> report = controller_.StallReport(now - period, 8);
    if (!report.empty()) line << " Waiting for: " << JoinNames(report, 9) << ".";
  }
  line << " A rank may be stuck or dead, or be running different collectives (names, order "
          "or count); see docs/errors.md.";
}

bool Runtime::LoopOnce() {
  if (stopped_) return false;
  const bool want_shutdown = WaitForWork();
  RoundResult round;
  if (!Negotiate(want_shutdown, &round)) return false;
  if (!Execute(round)) return false;
  return FinishRound(round, want_shutdown);
}

bool Runtime::WaitForWork() {
  bool want_shutdown;
  {
    std::unique_lock<std::mutex> lock(mu_);
    auto ready = [&] { return shutdown_requested_ || queue_.HasNew(); };
    if (!controller_.HasPending()) {
      // Work often follows work (a training step submits many tensors; a
      // latency-bound loop submits the next op right after reading the last):
      // poll briefly before sleeping, sparing a thread wake-up.
      const auto spin_until =
          std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
      while (!ready() && std::chrono::steady_clock::now() < spin_until) {
        lock.unlock();
        std::this_thread::yield();
        lock.lock();
      }
      wake_.wait(lock, ready);
    } else if (!made_progress_) {
      backoff_us_ = std::min<int64_t>(std::max<int64_t>(2 * backoff_us_, 50), 1000);
      wake_.wait_for(lock, std::chrono::microseconds(backoff_us_), ready);
    }
    want_shutdown = shutdown_requested_;
  }
  if (want_shutdown && shutdown_wait_started_ == std::chrono::steady_clock::time_point()) {
    shutdown_wait_started_ = std::chrono::steady_clock::now();
  }
  if (config_.cycle_time_ms > 0 && !want_shutdown) {
    std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(config_.cycle_time_ms));
  }
  ProcessTimeline().Cycle(std::chrono::steady_clock::now());
  return want_shutdown;
}

std::set<std::string> Runtime::StalledNames() const {
  std::set<std::string> stalled;
  if (config_.stall_shutdown_seconds > 0) {
    const auto cutoff = std::chrono::steady_clock::now() -
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(config_.stall_shutdown_seconds));
    size_t total = 0;
    for (std::string& name : queue_.EnqueuedBefore(cutoff, SIZE_MAX, &total)) {
      stalled.insert(std::move(name));
    }
  }
  return stalled;
}

bool Runtime::Negotiate(bool want_shutdown, RoundResult* round) {
  const std::set<std::string> stalled = StalledNames();
  if (tuner_) controller_.set_tuning_word(EncodeSetting(tuner_->current()));
  try {
    *round = controller_.RunRound(queue_.TakeNewRequests(), want_shutdown, stalled,
                                  [this](int64_t i) { return Idle(i); });
  } catch (const PeerGone& gone) {
    return StopAfterPeer(gone);
  }
  if (round->abandoned) {
    size_t total = 0;
    const std::vector<std::string> pending =
        queue_.EnqueuedBefore(std::chrono::steady_clock::now(), 8, &total);
    // Nothing of this rank's is pending: it waits in hvd.shutdown() for the
    // others to stop with it, and the stop is its own shutdown's.
    const bool in_shutdown = pending.empty();
    std::ostringstream why;
    why << "hvdmx: the other ranks have not taken part in negotiation for "
        << config_.stall_shutdown_seconds
        << " s (HVDMX_STALL_SHUTDOWN_TIME_SECONDS) while this rank waited "
        << (in_shutdown ? std::string("in hvd.shutdown() for them to stop with it")
                        : "for " + JoinNames(pending, 8))
        << "; a rank may have died or be stuck outside hvdmx. hvdmx has stopped on this "
           "rank: end the job and look at the other ranks' output (see docs/errors.md).";
    HVDMX_LOG(kError) << why.str();
    return Stop(in_shutdown ? Status::Shutdown(why.str()) : Status::Stalled(why.str()));
  }
  made_progress_ = !round->responses.empty();
  if (made_progress_) backoff_us_ = 0;
  TunedSetting setting;
  // Rank 0's setting, applied by every rank to this same round.
  if (DecodeSetting(round->tuning, &setting)) ApplyTuned(setting);
  return true;
}

void Runtime::ApplyTuned(const TunedSetting& setting) {
  config_.fusion_threshold = setting.fusion_threshold;
  config_.cycle_time_ms = setting.cycle_time_ms;
  config_.allreduce_algo = setting.algo;
  executor_.Apply(setting);
}

bool Runtime::Execute(const RoundResult& round) {
  try {
    executor_.FinishReduced(round.reduced, &queue_);
    executor_.Run(round.responses, &queue_);
  } catch (const PeerGone& gone) {
    return StopAfterPeer(gone);
  }
  CountReleased();
  return true;
}

bool Runtime::FinishRound(const RoundResult& round, bool want_shutdown) {
  if (tuner_) {
    int64_t bytes = 0;
    for (const ReducedUnit& unit : round.reduced) bytes += UnitBytes(unit.response);
    for (const Response& r : round.responses) bytes += UnitBytes(r);
    tuner_->RoundDone(bytes, std::chrono::steady_clock::now());
  }
  MaybeWarnStall();
  if (round.shutdown) {
    // Say so to this rank's later calls when its user did not shut hvdmx down.
    return Stop(want_shutdown ? Status::Ok() : Status::PeerShutdown(kShutDownByPeer));
  }
  return true;
}

bool Runtime::Stop(const Status& why) {
  if (!why.ok()) {
    std::lock_guard<std::mutex> lock(stop_mu_);
    if (stop_status_.ok()) stop_status_ = why;
  }
  stopped_ = true;
  // See Note [A peer that stops] in shm_region.h.
  if (shm_) shm_->MarkStopped();
  const Status status = StoppedStatus();
  // The round's entries that a peer's stop cut short, failed only now that
  // the stop status says why (Python decides on it when it reads the error).
  for (TensorEntry& entry : executor_.TakeUnfinished()) entry.callback(status);
  FailAll(status);
  return false;
}

bool Runtime::StopAfterPeer(const PeerGone& gone) {
  const std::string what = gone.what();
  const bool broke_protocol = dynamic_cast<const PeerProtocolError*>(&gone) != nullptr;
  // Note [A rank's finding reaches every rank] in negotiation/controller.h.
  if (broke_protocol) controller_.ReportStop(what);
  if (config_.elastic && !broke_protocol) {
    // A host of an elastic job may fail: one warning, without the advice to
    // end the job (hvd.elastic.run resets and goes on; the Python error keeps
    // the whole message).
    const size_t advice = what.find(kPeerGoneAdvice);
    HVDMX_LOG(kWarning) << what.substr(0, advice == std::string::npos ? what.size() : advice)
                        << "hvd.elastic.run goes on with the ranks left, from the last commit";
  } else {
    HVDMX_LOG(kError) << what;
  }
  return Stop(broke_protocol ? Status::PeerProtocol(what) : Status::PeerGone(what));
}

void Runtime::Loop() {
  // Sleep for what we ask, not for the default 50 us of timer slack: the
  // waits in Idle() are tens of microseconds.
  prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
  HVDMX_LOG(kDebug) << "background thread started; " << config_.ToString();
  while (LoopOnce()) {
  }
  HVDMX_LOG(kDebug) << "background thread stopped";
}

}  // namespace hvdmx
