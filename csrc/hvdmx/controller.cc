#include "controller.h"

namespace hvdmx {
namespace {
constexpr uint64_t kNothingForCoordinator = 1;
constexpr uint64_t kNoShutdown = 2;
}  // namespace

Controller::Controller(Comm& comm, int64_t cache_capacity)
    : comm_(comm),
      cache_(cache_capacity),
      bit_words_(1 + (cache_capacity + 63) / 64),
      joined_ranks_(comm.size(), false) {}

std::vector<std::string> Controller::PendingNames() const {
  std::vector<std::string> names;
  for (const auto& sent : at_coordinator_) names.push_back(sent.first);
  for (const auto& hit : cache_hits_) names.push_back(hit.second.name);
  return names;
}

RoundResult Controller::RunRound(std::vector<Request> new_requests, bool want_shutdown,
                                 const std::function<void(int64_t)>& idle) {
  // Step 1: sort new requests into cache hits and misses.
  std::vector<Request> misses;
  for (Request& q : new_requests) {
    if (q.type == CollectiveType::kJoin) joined_ = true;
    int64_t slot = q.type == CollectiveType::kJoin ? -1 : cache_.Lookup(q);
    if (slot >= 0 && cache_hits_.count(slot) == 0) {
      cache_hits_.emplace(slot, std::move(q));
    } else {
      misses.push_back(std::move(q));
    }
  }

  // Step 2: one bitwise AND over flags and cache bits.
  std::vector<uint64_t> bits(bit_words_, 0);
  bits[0] = ~uint64_t{0};
  if (!misses.empty() || !at_coordinator_.empty()) bits[0] &= ~kNothingForCoordinator;
  if (want_shutdown) bits[0] &= ~kNoShutdown;
  for (const auto& hit : cache_hits_) bits[1 + hit.first / 64] |= uint64_t{1} << (hit.first % 64);
  comm_.StartBitAnd(bits.data(), static_cast<int>(bits.size()));
  for (int64_t i = 0; !comm_.TestBitAnd(); ++i) idle(i);

  // Step 3: slots ready everywhere, in ascending order.
  RoundResult result;
  for (auto it = cache_hits_.begin(); it != cache_hits_.end();) {
    int64_t slot = it->first;
    if (bits[1 + slot / 64] & (uint64_t{1} << (slot % 64))) {
      cache_.Touch(slot);
      result.responses.push_back(cache_.response(slot));
      it = cache_hits_.erase(it);
    } else {
      ++it;
    }
  }

  // Step 4: the slow path through the coordinator.
  if ((bits[0] & kNothingForCoordinator) == 0) {
    for (auto& hit : cache_hits_) misses.push_back(std::move(hit.second));
    cache_hits_.clear();
    for (const Request& q : misses) at_coordinator_.emplace(q.name, q);
    std::vector<std::string> gathered = comm_.Gather(SerializeRequests(misses), 0);
    std::string wire;
    if (comm_.rank() == 0) {
      std::vector<Response> fresh;
      for (const std::string& part : gathered) Coordinate(ParseRequests(part), &fresh);
      CompleteForJoined(&fresh);
      wire = SerializeResponses(fresh);
    }
    comm_.BcastString(&wire, 0);
    for (Response& response : ParseResponses(wire)) {
      auto mine = at_coordinator_.find(response.name);
      if (mine == at_coordinator_.end()) {
        // A unit this rank joined through (see Note [Join]). Every rank must
        // put it into its cache, in the same order; ours gets a request no
        // real one can equal (device -2), so it never hits here.
        HVDMX_CHECK(joined_, "response for a name this rank did not send: " + response.name);
        Request phantom;
        phantom.type = response.type;
        phantom.name = response.name;
        phantom.device = -2;
        if (response.error.empty()) cache_.Put(phantom, response);
      } else {
        if (response.type == CollectiveType::kJoin) {
          joined_ = false;
        } else if (response.error.empty()) {
          cache_.Put(mine->second, response);
        }
        at_coordinator_.erase(mine);
      }
      result.responses.push_back(std::move(response));
    }
  }

  // Step 5.
  result.shutdown = (bits[0] & kNoShutdown) == 0;
  return result;
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
      if (!kv.second.received[r] && !joined_ranks_[r]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    }
    lines.push_back("'" + kv.first + "' (missing on ranks " + missing + ")");
  }
  return lines;
}

void Controller::Coordinate(const std::vector<Request>& requests, std::vector<Response>* out) {
  const int n = comm_.size();
  for (const Request& q : requests) {
    if (q.type == CollectiveType::kJoin) {
      HVDMX_CHECK(!joined_ranks_[q.rank], "rank joined twice");
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
    HVDMX_CHECK(!entry.received[q.rank], "rank sent the same name twice: " + q.name);
    entry.requests[q.rank] = q;
    entry.received[q.rank] = true;
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

}  // namespace hvdmx
