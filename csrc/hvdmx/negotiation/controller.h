// One negotiation round over a Comm and the response cache: decides which
// submitted tensors every rank is ready to run, in one order for all ranks.
//
// Note [Negotiation round]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A rank takes part in rounds only while it has work (pending requests) or
// wants to shut down; an idle rank sends nothing. A round is collective over
// the control communicator, so rounds happen in the same sequence everywhere.
//
// 1. Each new request is looked up in the cache. A hit (same name, same
//    parameters) is remembered by slot; a miss is queued for the coordinator.
// 2. Every rank contributes a bit vector to one bitwise-AND allreduce:
//      word 0, bit 0  "I have nothing for the coordinator" (no new misses and
//                     none of mine is still waiting there)
//      word 0, bit 1  "I do not want to shut down"
//      word 0, bit 2  "this bit-and carries everything step 4 would have
//                     me send the coordinator" (Note [Requests with the
//                     bit-and])
//      words 1..      bit s set: "my request in cache slot s is ready".
//      last word      the tuning setting: rank 0's, all ones elsewhere
//                     (Note [Autotune] in autotune.h).
//    The AND tells everyone which slots are ready on all ranks, whether the
//    slow path is needed and whether to shut down. This is the whole round in
//    steady state: no gather, no broadcast, no coordinator. Small cached
//    allreduces carry their operands with it (Note [Small tensors in the
//    round] in negotiation/round_reduction.h).
// 3. Ready slots become responses, in ascending slot order, and are touched
//    in the cache in that order; those whose operands came back reduced
//    are done (RoundResult::reduced) instead.
// 4. Slow path, only if some rank cleared word 0 bit 0: every rank moves its
//    remaining cache hits to its miss list (a rank whose request missed may be
//    waiting for ours at the coordinator), then the lists are gathered to
//    rank 0 (or were sent with the bit-and already). Rank 0 keeps each
//    name's requests until all ranks have sent one; then it checks that they
//    agree (type, dtypes, shapes, op, root, scale factors, device) and emits
//    a response, or an error response naming the ranks and values that
//    differ. The new responses are broadcast; every
//    rank appends them after the cached ones and puts the successful ones
//    into its cache, in broadcast order, so caches stay identical. When
//    what a rank sent rank 0 breaks the protocol (its requests, or its
//    gather's records), rank 0 broadcasts that finding instead of the
//    responses and every rank fails the round naming that rank
//    (PeerProtocolError; Note [Peer input] in comm/peer_input.h). What a
//    worker finds travels too (Note [A rank's finding reaches every rank]).
// 5. If some rank cleared word 0 bit 1, everyone runs this round's responses
//    and then stops.
//
// Note [A rank's finding reaches every rank]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Rank 0's findings travel in place of its responses (step 4), and a
// rank's bit-and message is read by every rank it reaches. But a worker can
// find that another rank broke the protocol where no other rank looks: a
// bit-and message sent to it alone, a tree gather's or broadcast's message
// from its child or parent. It then stops in the middle of a round, and
// without more the others would only see it stop taking part and fail
// after the stall shutdown time, never learning who lied. So a rank that
// stops on a PeerProtocolError, its own finding or one reported to it,
// tells every rank it negotiates with before it stops
// (ControlComm::ReportStop; Runtime::StopAfterPeer): a report that the
// transport frames apart from every message (TcpComm: the header's top
// bit, then at most 4 KiB of text). A rank reads it at its next receive
// from the reporter on the control comm, whatever that receive was for (a
// bit-and, the gather, a broadcast), or the one it is waiting in now, and
// fails with PeerProtocolError reading "rank 2 (host, address) reports
// that rank 1 (...) sent ...": the rank that reports it is named by the
// link it came on, which the job's key authenticates, and what it says
// follows; so a liar can make a report, but only one that starts with its
// own rank. Rank 0 meeting one in its gather treats it as its own finding
// and broadcasts it in place of the responses; every rank that stops on a
// report reports in turn ("rank 0 reports that rank 2 reports that ..."),
// so the finding floods the negotiation's links (every pair up to
// P2PComm::kDirectBitAndRanks ranks, the trees beyond) to every rank that
// is waiting in negotiation. The ranks tell each other at most once each,
// and wait at most a second for the bytes to leave. Not covered: a rank
// waiting in a collective's data transfer reads no control comm (it fails
// after the stall shutdown time, or reads the report at its next round);
// a host tree's non-leaders report nothing over the network (their host
// learns of their stop through shared memory), and neither do the
// shared-memory control comm of a job on one host (the same) nor MpiComm
// (HVDMX_TRANSPORT=mpi), whose ranks fail as before. LocalComm reports as
// TcpComm does, for the in-process tests (tests/test_peer_input.py).
//
// Note [Requests with the bit-and]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Where the comm can carry bytes with its bit-and (the shared-memory
// control comm, when every rank is on one host), a rank that clears word 0
// bit 0 itself sends with its bit-and what step 4 would send: its misses,
// then each cache hit still waiting with its slot. A rank with nothing for
// the coordinator and no hits waiting sends nothing, which is also what
// step 4 would have it send. Either sets word 0 bit 2; a rank whose list
// would not fit, or that holds hits but has nothing of its own for the
// coordinator (building the list every round while hits wait would cost
// the steady state), clears it. If it stays set, step 4 gathers nothing:
// rank 0 reads every rank's list, leaving out the hits whose slots the AND
// made ready, which step 3 answered from the cache. That is exactly the
// list the gather would have brought, so a round needs one exchange fewer
// and the slow path costs one broadcast more than the steady state, not a
// gather and a broadcast. If the bit is cleared, step 4 gathers as before.
//
// Note [Join]
// ~~~~~~~~~~~
// A rank that has run out of data calls join(): a request of type kJoin that
// always goes to the coordinator and is never cached. While it waits there
// the rank keeps word 0 bit 0 cleared, so every round takes the slow path,
// and it never sets a cache bit, so no cached unit becomes ready without it.
// Rank 0 treats joined ranks as having submitted everything: a unit is
// complete once every rank that has not joined has submitted it. An allreduce
// then runs on every rank, the joined ones taking part with zeros (a
// "phantom" response: the name is not in their queue); any other collective
// gets an error response, since a joined rank has no data to give it. When
// the last rank joins, rank 0 answers the join of every rank with the rank
// that joined last, and the job goes on with no rank joined.
// A rank's join request must follow every collective that rank called
// before join(); those still inside MXNet's engine are waited for first
// (Runtime::AddInEngine), or they would complete without the rank's data.
//
// Note [Stall shutdown]
// ~~~~~~~~~~~~~~~~~~~~~~
// With HVDMX_STALL_SHUTDOWN_TIME_SECONDS = T > 0, a unit some ranks have
// submitted and others have not fails on every rank after T seconds instead
// of waiting forever. A rank whose entry has waited T seconds marks its
// request `stalled` and clears word 0 bit 0, so the round takes the slow path
// even if the unit was a cache hit; rank 0 answers a stalled or T-seconds-old
// incomplete unit with an error response naming the ranks that did not
// submit it. Ranks that never submitted it ignore that response. This needs
// the other ranks to take part in rounds, which they do whenever they have
// work pending; a rank that is dead or busy outside hvdmx takes part in none,
// so the runtime also gives up a single round after waiting T seconds for it
// (runtime.h).
//
// Threading: only the runtime's background thread calls a Controller.
#ifndef HVDMX_CONTROLLER_H_
#define HVDMX_CONTROLLER_H_

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "comm/comm.h"
#include "negotiation/message.h"
#include "negotiation/response_cache.h"
#include "negotiation/round_reduction.h"

namespace hvdmx {

struct RoundResult {
  std::vector<ReducedUnit> reduced;  // identical on every rank, done in the round
  std::vector<Response> responses;   // identical on every rank, in run order
  bool shutdown = false;             // some rank asked to shut down
  bool abandoned = false;            // `idle` gave up waiting for the peers
  uint64_t tuning = ~uint64_t{0};    // rank 0's tuning word (see autotune.h)
};

class Controller {
 public:
  // `stall_shutdown_seconds`: see Note [Stall shutdown]; 0 disables it.
  // `round_allreduce_bytes`: see Note [Small tensors in the round]; 0 (or
  // no input reader) turns it off.
  Controller(ControlComm& comm, int64_t cache_capacity, double stall_shutdown_seconds = 0.0,
             int64_t round_allreduce_bytes = 0);
  // Where the round reads the inputs of this rank's pending entry `name`
  // (false: it has none), for the operands it sends with the bit-and.
  using InputReader = std::function<bool(const std::string& name, std::vector<const void*>*)>;
  void set_input_reader(InputReader reader) { read_inputs_ = std::move(reader); }
  // Words of each round's bit-and (flags, cache bits, tuning word).
  static int BitWords(int64_t cache_capacity) {
    return static_cast<int>(1 + (cache_capacity + 63) / 64 + 1);
  }

  // Runs one round (see Note [Negotiation round]). `stalled` names this
  // rank's entries that have waited the stall shutdown time. `idle` is
  // called while waiting for peers, with the number of times it was called
  // before; when it returns false the round is abandoned (the controller is
  // then unusable: the peers' half of the round is still outstanding).
  RoundResult RunRound(std::vector<Request> new_requests, bool want_shutdown,
                       const std::set<std::string>& stalled,
                       const std::function<bool(int64_t)>& idle);

  // Tells the ranks this one negotiates with that it stopped on `finding`
  // (Note [A rank's finding reaches every rank]).
  void ReportStop(const std::string& finding) { comm_.ReportStop(finding); }

  // Requests this rank has submitted that have no response yet.
  bool HasPending() const { return !cache_hits_.empty() || !at_coordinator_.empty(); }
  // What this rank contributes to the next rounds' tuning word (the last
  // word of the AND): rank 0's setting, all ones elsewhere.
  void set_tuning_word(uint64_t word) { tuning_word_ = word; }

  const ResponseCache& cache() const { return cache_; }
  // Rounds that took the slow path with the requests sent along with the
  // bit-and, and those that gathered them after it; any thread may read.
  int64_t sent_with_bit_and() const { return sent_with_bit_and_.load(std::memory_order_relaxed); }
  int64_t gathered() const { return gathered_.load(std::memory_order_relaxed); }
  // Allreduces this rank completed inside negotiation rounds; any thread.
  int64_t reduced_in_round() const { return reduced_in_round_.load(std::memory_order_relaxed); }

  // Rank 0: for units some ranks submitted before `cutoff` and others have
  // not submitted at all, "'name' (missing on ranks 1, 3)"; at most `limit`.
  std::vector<std::string> StallReport(std::chrono::steady_clock::time_point cutoff,
                                       size_t limit) const;

 private:
  // Step 4 of Note [Negotiation round]: appends the coordinator's responses
  // to result->responses. Throws CommAbandoned when the comm's idle function
  // gives up on the exchange.
  void SlowPath(const std::vector<uint64_t>& bits, std::vector<Request> misses,
                RoundResult* result);
  // Rank 0 only: adds `requests` (parsed: each request's rank is in range)
  // to the table; appends completed units' responses to *out. A rank that
  // joins twice or sends a name twice throws PeerProtocolError naming it.
  void Coordinate(const std::vector<Request>& requests, std::vector<Response>* out);
  // Rank 0 only: appends the responses of units that became complete
  // because ranks joined (see Note [Join]), and the join's own response once
  // every rank has joined.
  void CompleteForJoined(std::vector<Response>* out);
  // Rank 0 only: error responses for incomplete units that a rank marked
  // stalled or that are older than the stall shutdown time.
  void FailStalled(std::vector<Response>* out);

  ControlComm& comm_;
  double stall_shutdown_seconds_;
  ResponseCache cache_;
  int64_t bit_words_;  // flags, cache bits, tuning word
  uint64_t tuning_word_ = ~uint64_t{0};
  std::map<int64_t, Request> cache_hits_;          // slot -> request, waiting for its bit
  std::map<std::string, Request> at_coordinator_;  // sent to rank 0, no response yet
  bool joined_ = false;                            // this rank's join is at the coordinator
  // Rank 0: per name, the requests received so far (index = rank).
  struct TableEntry {
    std::vector<Request> requests;
    std::vector<bool> received;
    int count = 0;
    std::chrono::steady_clock::time_point first_seen;
    bool stalled = false;
  };
  std::unordered_map<std::string, TableEntry> table_;
  // Rank 0: ranks whose join is pending, and the join requests themselves.
  std::vector<bool> joined_ranks_;
  int joined_count_ = 0;
  Request join_request_;
  int last_joined_ = -1;
  std::atomic<int64_t> sent_with_bit_and_{0};
  std::atomic<int64_t> gathered_{0};
  // Note [Small tensors in the round].
  RoundReduction reduction_;
  InputReader read_inputs_;
  BitAndPartial partial_;
  std::atomic<int64_t> reduced_in_round_{0};
};

}  // namespace hvdmx

#endif  // HVDMX_CONTROLLER_H_
