// The runtime of one process set: owns the control and data comms the job
// wired for it (job/comm_wiring.h), its shared memory, the queue, the
// controller and the executor, and the background thread that drives them.
// An object, not a bag of globals: the job (job/job.h) holds one for the
// global set and one for each process set this rank is in, and builds them
// again in the same process after a shutdown (elastic).
//
// Note [Background loop]
// ~~~~~~~~~~~~~~~~~~~~~~
// The background thread sleeps on a condition variable while this rank has
// nothing pending, so an idle process costs no CPU and sends nothing. When
// work arrives it optionally waits HVDMX_CYCLE_TIME to batch more, runs one
// negotiation round (controller.h) and executes the round's responses. While
// requests are still pending after a round that completed none (peers have
// not submitted them yet), the next round waits a short, growing backoff
// unless new local work arrives first, so ranks waiting on each other do not
// spin. The wait for the round's bit-AND blocks in poll(2) where the control
// comm wakes on arrival (TCP, a host tree's leaders: Note [Waiting for the
// network] in comm/tcp_comm.h); over MPI or shared memory it polls: a short
// spin, then sleeps growing to 1 ms (Runtime::Idle). (A collective waits as
// its transport does: MPI polls without sleeping, TCP blocks in poll(2),
// shared memory spins, yields, then sleeps briefly: shm/shm_internal.h.)
//
// With HVDMX_STALL_SHUTDOWN_TIME_SECONDS = T > 0, stalled collectives fail
// on every rank after T seconds (Note [Stall shutdown] in controller.h). If a
// single round's bit-AND has waited T seconds, the peers are not taking part
// in rounds at all (dead, or busy outside hvdmx): the runtime then fails
// everything pending on this rank with that report and stops, since the
// round it abandoned can never complete. A peer on this host that stops or
// dies while this rank waits for it in shared memory stops this rank too, at
// once (Note [A peer that stops] in shm_region.h).
//
// Note [Shutdown]
// ~~~~~~~~~~~~~~~
// Shutdown() sets a flag that the next round carries to every rank (word 0
// bit 1). Once any rank asks, every rank runs that round's responses, fails
// the entries still pending with a "shut down" status, and its background
// thread exits. Shutdown() returns after the thread has been joined. Entries
// enqueued after that fail at once.
#ifndef HVDMX_RUNTIME_H_
#define HVDMX_RUNTIME_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "comm/comm.h"
#include "config/env_config.h"
#include "negotiation/controller.h"
#include "negotiation/tensor_queue.h"
#include "runtime/autotune.h"
#include "runtime/executor.h"
#include "shm/shm_host.h"

namespace hvdmx {

class Runtime {
 public:
  // `control` carries negotiation, `data` the collectives' bytes; both span
  // the same ranks, and the job chose both (job/comm_wiring.h). `shm`,
  // optional, is shared memory (shm_host.h) over those ranks' hosts; it
  // outlives `control`, which may use it. `hosts`: which of the ranks share
  // a host (see Executor); `peers_on_host`: another of the ranks runs on
  // this host (see Executor).
  Runtime(std::unique_ptr<ControlComm> control, std::unique_ptr<DataComm> data,
          const Config& config, std::unique_ptr<ShmHost> shm, HostMap hosts, bool peers_on_host);
  ~Runtime();

  // Starts the background thread.
  void Start();

  int rank() const { return control_->rank(); }
  // How this runtime's ranks talk: tcp or mpi (Config::transport, resolved).
  Transport transport() const { return config_.transport; }
  int size() const { return control_->size(); }
  const Config& config() const { return config_; }
  // Null unless the shared-memory allreduce is on.
  const ShmHost* shm() const { return shm_.get(); }
  // For tests: bytes the fusion buffer holds (it grows on the background
  // thread; read it only once the collectives that grew it are done).
  int64_t fusion_buffer_bytes() const { return executor_.fusion_buffer_bytes(); }
  const HugePageCollapser& mpi_pages() const { return executor_.mpi_pages(); }
  const Controller& controller() const { return controller_; }
  // The negotiation's comm (for stats).
  const ControlComm& control() const { return *control_; }

  // Any thread (MXNet engine threads). Refuses, returning the error and
  // leaving the callback unfired, an entry without a turn whose name is
  // already queued on this rank. Otherwise the callback fires exactly once,
  // from the background thread (or at once if the runtime has stopped).
  // An entry with a turn waits for the turns before it (Note [Same-name
  // calls in flight] in tensor_queue.h), counted as still in the engine
  // meanwhile (see AddInEngine).
  Status Enqueue(TensorEntry entry);
  // The thread that calls the collective, at the call: the name's next
  // turn, for the entry's `turn`; Cancel when the call fails before it is
  // pushed.
  uint64_t ReserveTurn(const std::string& name) { return queue_.Reserve(name); }
  void CancelTurn(const std::string& name, uint64_t turn) { queue_.Cancel(name, turn); }

  // Collectives pushed onto MXNet's engine for this runtime whose entries
  // the engine has not yet handed to Enqueue (it runs an op only once its
  // inputs are ready). join() waits for none to be left, so that its request
  // reaches the coordinator after every collective called before it: a unit
  // still inside the engine would otherwise complete without this rank's
  // data (Note [Join] in controller.h). Any thread.
  void AddInEngine(int delta);
  // Waits up to `timeout` for no collective to be inside the engine; true
  // when none is.
  bool WaitNoneInEngine(std::chrono::milliseconds timeout);
  // True when no collective of this runtime is inside MXNet's engine or
  // waiting here for the other ranks (a round may still be running the last
  // ones; they complete without waiting for anything else). Any thread.
  bool NothingPending();

  // See Note [Shutdown]. Idempotent. Any thread but the background thread.
  void Shutdown();
  bool stopped() const { return stopped_; }
  // Why the runtime stopped when this rank's Shutdown() did not stop it
  // alone: kStalled (the stall shutdown gave up on the peers while this rank
  // waited for collectives), kShutdown (it gave up on them while this rank
  // waited in Shutdown()), kPeerShutdown (another rank's Shutdown()) or
  // kPeerGone (a PeerGone from a transport or shared memory), kPeerProtocol
  // (a PeerProtocolError: a peer broke the protocol, or a peer reports that
  // one did); Ok otherwise.
  // The code decides; the message is the report for the user.
  Status stop_status() {
    std::lock_guard<std::mutex> lock(stop_mu_);
    return stop_status_;
  }

  // One pass of the background loop (see Note [Background loop]): the
  // phases below, in order; returns false once the runtime has stopped.
  // Exposed for tests.
  bool LoopOnce();

 private:
  void Loop();
  // LoopOnce's phases, on the background thread. Each that can stop the
  // runtime returns false once it has.
  // Waits for new work (or shutdown, or the next try of a round that waits
  // for peers), then for the cycle time; returns whether shutdown was asked.
  bool WaitForWork();
  // Stall bookkeeping before a round: the names pending for longer than the
  // stall shutdown time, which the round then fails on every rank.
  std::set<std::string> StalledNames() const;
  // Runs one negotiation round into *round, and applies the setting
  // autotune chose for it; stops when a peer in shared memory is gone or
  // the round was abandoned after the stall shutdown time.
  bool Negotiate(bool want_shutdown, RoundResult* round);
  // Runs the round's responses; stops when a peer in shared memory is gone.
  bool Execute(const RoundResult& round);
  // After the round: autotune's score, the stall warning, and a shutdown
  // that the round agreed on.
  bool FinishRound(const RoundResult& round, bool want_shutdown);
  // Hands autotune's setting (rank 0's, the same on every rank for the same
  // round) to the loop (cycle time) and the executor.
  void ApplyTuned(const TunedSetting& setting);
  void FailAll(const Status& status);
  // Entries that waited for their turn leave the engine's count once they
  // enter negotiation or fail (see Enqueue). Background thread.
  void CountReleased();
  // Stops the runtime from the background thread: records `why` (unless Ok
  // or a reason is there already), tells the host's peers (Note [A
  // peer that stops] in shm_region.h) and fails everything pending.
  // Returns false, for LoopOnce.
  bool Stop(const Status& why);
  // Stop after a peer in shared memory stopped or died in the middle of a
  // round.
  bool StopAfterPeer(const PeerGone& gone);
  // The status for entries that arrive after the runtime has stopped.
  Status StoppedStatus();
  // Waits a little while a round waits for peers; false once it has waited
  // the stall shutdown time (the round is then abandoned).
  bool Idle(int64_t iteration);
  // Logs (at most once per HVDMX_STALL_CHECK_TIME_SECONDS) the collectives
  // pending on this rank for longer than that; rank 0 adds which ranks have
  // not submitted them.
  void MaybeWarnStall();

  std::unique_ptr<ShmHost> shm_;  // before control_ and executor_, which use it
  std::unique_ptr<ControlComm> control_;
  std::unique_ptr<DataComm> data_;
  Config config_;
  TensorQueue queue_;
  Controller controller_;
  Executor executor_;
  std::unique_ptr<Autotuner> tuner_;  // rank 0 with HVDMX_AUTOTUNE=1

  std::mutex mu_;  // guards the wake-up condition below
  std::condition_variable wake_;
  bool shutdown_requested_ = false;
  std::atomic<bool> stopped_{false};
  std::mutex in_engine_mu_;  // guards in_engine_
  std::condition_variable in_engine_cv_;
  int64_t in_engine_ = 0;
  std::mutex stop_mu_;
  Status stop_status_;  // why the runtime stopped, when not by Shutdown() alone
  bool made_progress_ = true;
  int64_t backoff_us_ = 0;
  std::chrono::steady_clock::time_point wait_started_;
  std::chrono::steady_clock::time_point next_stall_check_;
  std::chrono::steady_clock::time_point last_stall_warning_;
  // When this rank's Shutdown() began to wait for the others (see
  // MaybeWarnStall); the epoch until then.
  std::chrono::steady_clock::time_point shutdown_wait_started_;

  std::thread thread_;
};

}  // namespace hvdmx

#endif  // HVDMX_RUNTIME_H_
