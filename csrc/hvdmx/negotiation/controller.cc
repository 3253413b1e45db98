#include "negotiation/controller.h"

#include <sstream>

#include "base/timeline.h"

namespace hvdmx {
namespace {
constexpr uint64_t kNothingForCoordinator = 1;
constexpr uint64_t kNoShutdown = 2;
constexpr uint64_t kSentWithBitAnd = 4;

// Whether slot `s`'s bit is set in a round's bit-and words.
bool SlotBit(const std::vector<uint64_t>& bits, int64_t s) {
  return (bits[1 + s / 64] & (uint64_t{1} << (s % 64))) != 0;
}

// The requests a rank sent with a round's bit-and that it sends the
// coordinator, now that the AND came out as `bits`: its misses, and each
// hit whose slot is not ready everywhere (step 3 answered a ready one from
// the cache). See Note [Requests with the bit-and].
// `from` sent `payload`, in a comm of `size` ranks whose caches hold
// `cache_capacity` (Note [Peer input] in comm/peer_input.h).
std::vector<Request> ForCoordinator(const std::string& payload, const std::vector<uint64_t>& bits,
                                    const PeerSender& from, int size, int64_t cache_capacity) {
  if (payload.empty()) return {};  // a rank with nothing for it
  std::vector<int64_t> slots;
  std::vector<Request> sent = ParseRequests(payload, from, size, cache_capacity, &slots);
  std::vector<Request> out;
  for (size_t i = 0; i < sent.size(); ++i) {
    if (slots[i] < 0 || !SlotBit(bits, slots[i])) out.push_back(std::move(sent[i]));
  }
  return out;
}
}  // namespace

Controller::Controller(ControlComm& comm, int64_t cache_capacity, double stall_shutdown_seconds,
                       int64_t round_allreduce_bytes)
    : comm_(comm),
      stall_shutdown_seconds_(stall_shutdown_seconds),
      cache_(cache_capacity),
      bit_words_(BitWords(cache_capacity)),
      joined_ranks_(comm.size(), false),
      reduction_(cache_, round_allreduce_bytes) {
  partial_.reduction = &reduction_;
}

RoundResult Controller::RunRound(std::vector<Request> new_requests, bool want_shutdown,
                                 const std::set<std::string>& stalled,
                                 const std::function<bool(int64_t)>& idle) {
  // Step 1: sort new requests into cache hits and misses.
  std::vector<Request> misses;
  for (Request& q : new_requests) {
    if (q.type == CollectiveType::kJoin) joined_ = true;
    int64_t slot = q.type == CollectiveType::kJoin || !q.error.empty() ? -1 : cache_.Lookup(q);
    if (slot >= 0 && cache_hits_.count(slot) == 0) {
      cache_hits_.emplace(slot, std::move(q));
    } else {
      misses.push_back(std::move(q));
    }
  }

  // Step 2: one bitwise AND over flags and cache bits.
  std::vector<uint64_t> bits(bit_words_, 0);
  bits[0] = ~uint64_t{0};
  // Marked once here, for step 4 and for what is sent with the bit-and.
  for (Request& q : misses) q.stalled = stalled.count(q.name) > 0;
  bool stalled_hit = false;
  for (auto& hit : cache_hits_) {
    hit.second.stalled = stalled.count(hit.second.name) > 0;
    stalled_hit |= hit.second.stalled;
  }
  const bool for_coordinator = !misses.empty() || !at_coordinator_.empty() || stalled_hit;
  if (for_coordinator) bits[0] &= ~kNothingForCoordinator;
  if (want_shutdown) bits[0] &= ~kNoShutdown;
  for (const auto& hit : cache_hits_) bits[1 + hit.first / 64] |= uint64_t{1} << (hit.first % 64);
  bits.back() = tuning_word_;
  // What step 4 would send rank 0, sent now (Note [Requests with the
  // bit-and]); a rank that holds hits but has nothing of its own for the
  // coordinator does not build it, and step 4 then gathers as before.
  std::string payload;
  const int64_t capacity = comm_.BitAndPayloadCapacity();
  bool sent = capacity > 0 && (for_coordinator || cache_hits_.empty());
  if (sent && for_coordinator) {
    std::vector<Request> sending = misses;
    std::vector<int64_t> slots(misses.size(), -1);
    for (const auto& hit : cache_hits_) {
      sending.push_back(hit.second);
      slots.push_back(hit.first);
    }
    payload = SerializeRequests(sending, slots);
    sent = static_cast<int64_t>(payload.size()) <= capacity;
    if (!sent) payload.clear();
  }
  if (!sent) bits[0] &= ~kSentWithBitAnd;
  // Operands of the small cached allreduces (Note [Small tensors in the round]).
  const bool combining = reduction_.enabled() && read_inputs_ && comm_.CombinesPartials();
  if (combining) {
    partial_.mine.clear();
    std::vector<const void*> inputs;
    for (const auto& hit : cache_hits_) {
      if (reduction_.Takes(hit.first, partial_.mine.size()) &&
          read_inputs_(hit.second.name, &inputs)) {
        reduction_.Append(hit.first, inputs, &partial_.mine);
      }
    }
    comm_.StartBitAndCombining(bits.data(), static_cast<int>(bits.size()), payload, &partial_);
  } else {
    comm_.StartBitAndWithPayload(bits.data(), static_cast<int>(bits.size()), payload);
  }
  RoundResult result;
  for (int64_t i = 0; !comm_.TestBitAnd(); ++i) {
    if (!idle(i)) {
      result.abandoned = true;
      return result;
    }
  }

  result.tuning = bits.back();

  // Step 3: slots ready everywhere, in ascending order.
  std::map<int64_t, std::string> reduced;
  if (combining) {
    // The comm checked each peer's partial as it came (Note [Peer input]).
    const PeerSender combined{
        comm_.rank(), "the round's bit-and, combined on rank " + std::to_string(comm_.rank())};
    reduced = reduction_.Records(partial_.combined, combined);
  }
  for (auto it = cache_hits_.begin(); it != cache_hits_.end();) {
    int64_t slot = it->first;
    if (SlotBit(bits, slot)) {
      cache_.Touch(slot);
      auto done = reduced.find(slot);
      if (done != reduced.end()) {
        result.reduced.push_back(ReducedUnit{cache_.response(slot), std::move(done->second)});
      } else {
        result.responses.push_back(cache_.response(slot));
      }
      it = cache_hits_.erase(it);
    } else {
      ++it;
    }
  }

  // Step 4: the slow path through the coordinator.
  if ((bits[0] & kNothingForCoordinator) == 0) {
    try {
      SlowPath(bits, std::move(misses), &result);
    } catch (const CommAbandoned&) {
      result.abandoned = true;
      return result;
    }
  }

  // Step 5.
  result.shutdown = (bits[0] & kNoShutdown) == 0;
  reduced_in_round_.fetch_add(static_cast<int64_t>(result.reduced.size()),
                              std::memory_order_relaxed);
  return result;
}

void Controller::SlowPath(const std::vector<uint64_t>& bits, std::vector<Request> misses,
                          RoundResult* result_out) {
  RoundResult& result = *result_out;
  for (auto& hit : cache_hits_) misses.push_back(std::move(hit.second));
  cache_hits_.clear();
  for (const Request& q : misses) at_coordinator_.emplace(q.name, q);
  const bool with_bit_and = (bits[0] & kSentWithBitAnd) != 0;
  // Rank 0: what a rank sent that breaks the protocol, if anything. It
  // fails the job on every rank, naming that rank: the broadcast carries
  // this finding instead of the responses, and every rank's ParseResponses
  // throws it.
  std::string finding;
  std::vector<std::string> gathered;
  if (with_bit_and) {
    sent_with_bit_and_.fetch_add(1, std::memory_order_relaxed);
  } else {
    try {
      gathered = comm_.Gather(SerializeRequests(misses), 0);
    } catch (const PeerProtocolError& e) {
      // The root can still broadcast: it has received all it waits for, or
      // a rank's report of what another sent (Note [A rank's finding
      // reaches every rank]), after which the rest no longer matters.
      if (comm_.rank() != 0) throw;
      finding = SerializePeerFailure(e.peer(), e.what());
    }
    gathered_.fetch_add(1, std::memory_order_relaxed);
  }
  std::string wire = finding;
  if (comm_.rank() == 0 && finding.empty()) {
    try {
      std::vector<Response> fresh;
      const int n = comm_.size();
      for (int j = 0; j < n; ++j) {
        const PeerSender from = PeerSender::Rank(j);
        Coordinate(with_bit_and
                       ? ForCoordinator(comm_.BitAndPayload(j), bits, from, n, cache_.capacity())
                       : ParseRequests(gathered[j], from, n),
                   &fresh);
      }
      CompleteForJoined(&fresh);
      FailStalled(&fresh);
      wire = SerializeResponses(fresh);
    } catch (const PeerProtocolError& e) {
      wire = SerializePeerFailure(e.peer(), e.what());
    }
  }
  comm_.BcastString(&wire, 0);
  for (Response& response : ParseResponses(wire, PeerSender::Rank(0), comm_.size())) {
    auto mine = at_coordinator_.find(response.name);
    if (mine == at_coordinator_.end() && !response.error.empty()) {
      // A unit failed by the stall shutdown that this rank never
      // submitted (see Note [Stall shutdown]): nothing to do here, and
      // failed units are not cached.
      continue;
    }
    if (mine == at_coordinator_.end()) {
      // A unit this rank joined through (see Note [Join]). Every rank must
      // put it into its cache, in the same order; ours gets a request no
      // real one can equal (device -2), so it never hits here.
      if (!joined_) {
        FailPeerInput(PeerSender::Rank(0),
                      "a response for '" + response.name +
                          "', which this rank neither requested nor joined through");
      }
      Request phantom;
      phantom.type = response.type;
      phantom.name = response.name;
      phantom.device = -2;
      if (response.error.empty()) cache_.Put(phantom, response);
    } else {
      if (response.type == CollectiveType::kJoin) {
        joined_ = false;
      } else if (response.error.empty()) {
        CheckResponseFits(mine->second, response, PeerSender::Rank(0));
        cache_.Put(mine->second, response);
      }
      at_coordinator_.erase(mine);
    }
    result.responses.push_back(std::move(response));
  }
}

std::vector<std::string> Controller::StallReport(std::chrono::steady_clock::time_point cutoff,
                                                 size_t limit) const {
  std::vector<std::string> lines;
  for (const auto& kv : table_) {
    if (kv.second.first_seen >= cutoff) continue;
    if (lines.size() == limit) {
      lines.push_back("...");
      break;
    }
    std::string missing;
    for (size_t r = 0; r < kv.second.received.size(); ++r) {
      if (!kv.second.received[r] && !joined_ranks_[r])
        missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    }
    lines.push_back("'" + kv.first + "' (missing on ranks " + missing + ")");
  }
  return lines;
}

void Controller::Coordinate(const std::vector<Request>& requests, std::vector<Response>* out) {
  const int n = comm_.size();
  for (const Request& q : requests) {
    if (q.type == CollectiveType::kJoin) {
      if (joined_ranks_[q.rank]) {
        FailPeerInput(PeerSender::Rank(q.rank), "a second join request while its first is pending");
      }
      joined_ranks_[q.rank] = true;
      ++joined_count_;
      join_request_ = q;
      last_joined_ = q.rank;
      continue;
    }
    TableEntry& entry = table_[q.name];
    if (entry.requests.empty()) {
      entry.requests.resize(n);
      entry.received.assign(n, false);
      entry.first_seen = std::chrono::steady_clock::now();
    }
    if (entry.received[q.rank]) {
      FailPeerInput(PeerSender::Rank(q.rank),
                    "a second request for '" + q.name + "' while its first is pending");
    }
    entry.requests[q.rank] = q;
    entry.received[q.rank] = true;
    ProcessTimeline().Mark(q.name, "rank " + std::to_string(q.rank) + " ready",
                           std::chrono::steady_clock::now());
    entry.stalled |= q.stalled;
    if (++entry.count == n) {
      out->push_back(MakeResponse(entry.requests));
      table_.erase(q.name);
    }
  }
}

void Controller::CompleteForJoined(std::vector<Response>* out) {
  if (joined_count_ == 0) return;
  const int n = comm_.size();
  for (auto it = table_.begin(); it != table_.end();) {
    const TableEntry& entry = it->second;
    std::vector<Request> present;
    std::string joined;
    bool complete = true;
    for (int r = 0; r < n; ++r) {
      if (entry.received[r]) {
        present.push_back(entry.requests[r]);
      } else if (joined_ranks_[r]) {
        joined += (joined.empty() ? "" : ", ") + std::to_string(r);
      } else {
        complete = false;
      }
    }
    if (!complete) {
      ++it;
      continue;
    }
    const Request& first = present[0];
    if (first.type == CollectiveType::kAllreduce) {
      out->push_back(MakeResponse(present));
    } else {
      out->push_back(ErrorResponse(
          first, "hvdmx: " + CollectiveTypeName(first.type) + " of tensor '" + first.name +
                     "' cannot run because rank(s) " + joined +
                     " have called join() and have no data for it; only allreduce runs "
                     "while ranks have joined (they contribute zeros). Call it on every rank "
                     "before any rank calls join()."));
    }
    it = table_.erase(it);
  }
  if (joined_count_ == n) {
    Response done;
    done.type = CollectiveType::kJoin;
    done.name = join_request_.name;
    done.root = last_joined_;
    out->push_back(done);
    joined_ranks_.assign(n, false);
    joined_count_ = 0;
  }
}

void Controller::FailStalled(std::vector<Response>* out) {
  if (stall_shutdown_seconds_ <= 0) return;
  const auto cutoff = std::chrono::steady_clock::now() -
                      std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                          std::chrono::duration<double>(stall_shutdown_seconds_));
  for (auto it = table_.begin(); it != table_.end();) {
    const TableEntry& entry = it->second;
    if (!entry.stalled && entry.first_seen > cutoff) {
      ++it;
      continue;
    }
    std::string have, missing;
    const Request* first = nullptr;
    for (size_t r = 0; r < entry.received.size(); ++r) {
      std::string& list = entry.received[r] ? have : missing;
      list += (list.empty() ? "" : ", ") + std::to_string(r);
      if (entry.received[r] && first == nullptr) first = &entry.requests[r];
    }
    std::ostringstream msg;
    msg << "hvdmx: " << CollectiveTypeName(first->type) << " of tensor '" << it->first
        << "' was submitted by rank(s) " << have << " but not by rank(s) " << missing << " within "
        << stall_shutdown_seconds_
        << " s (HVDMX_STALL_SHUTDOWN_TIME_SECONDS), so it has failed on every rank instead "
           "of waiting on. A rank may be stuck or dead, or be running different collectives "
           "(names, order or count); see docs/errors.md.";
    out->push_back(ErrorResponse(*first, msg.str()));
    it = table_.erase(it);
  }
}

}  // namespace hvdmx
