// Entries submitted on this rank and not yet completed, by name.
//
// Note [Same-name calls in flight]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A name identifies a collective across ranks, so one name can be in
// negotiation only once at a time on a rank. A program may still call
// `hvd.broadcast(x, name='b')` once per step without reading the result in
// between: the calls of one name take turns, in the order the program made
// them. Each engine-pushed call reserves the name's next turn at the call
// (Reserve, on the calling thread), and its entry enters negotiation only
// when the turn before it has completed; until then it waits here, apart
// from the entries that negotiate. The engine may run two such ops in
// either order (they touch different arrays), so the order of the calls,
// not of the engine, decides. Every rank makes the same calls in the same
// order, so each name's turns line up across ranks. Entries without a turn
// (the blocking rounds: sizes, barrier, join) keep the old rule: a second
// entry of a pending name is refused, since nothing orders it.
//
// Add is called from MXNet engine threads, Reserve and Cancel from the
// threads that call collectives; everything else from the runtime's
// background thread. One mutex guards it all.
#ifndef HVDMX_TENSOR_QUEUE_H_
#define HVDMX_TENSOR_QUEUE_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "base/common.h"
#include "negotiation/message.h"

namespace hvdmx {

// One negotiation unit on this rank: its request, the data pointers of each
// tensor (input and output may be the same), and the callback to fire once.
struct TensorEntry {
  Request request;
  std::vector<const void*> inputs;
  std::vector<void*> outputs;
  std::function<void(const Status&)> callback;
  // Optional: called with the response just before a successful callback,
  // for calls that need what the negotiation decided (sizes, join's rank).
  std::function<void(const Response&)> on_response;
  std::chrono::steady_clock::time_point enqueued = std::chrono::steady_clock::now();
  // The name's turn this entry holds (TensorQueue::Reserve), or kNoTurn.
  static constexpr uint64_t kNoTurn = ~uint64_t{0};
  uint64_t turn = kNoTurn;
};

class TensorQueue {
 public:
  // The next turn of `name` (see Note [Same-name calls in flight]).
  uint64_t Reserve(const std::string& name);
  // Gives up a turn whose entry will never be added (its push failed).
  void Cancel(const std::string& name, uint64_t turn);
  // Adds the entry: to negotiation, or, when it holds a turn whose previous
  // turn has not completed, to wait for it (*deferred then set). Fails,
  // leaving the callback unfired, for an entry without a turn whose name is
  // pending.
  Status Add(TensorEntry entry, bool* deferred = nullptr);
  // Entries that had waited for their turn and have since entered
  // negotiation or been taken by TakeAll; resets the count.
  int64_t TakeReleasedCount();
  // The requests added since the last call, in the order they were added.
  std::vector<Request> TakeNewRequests();
  bool HasNew() const;
  // Removes the entry into *out; false if there is none by that name (a unit
  // this rank joined through, see Note [Join] in controller.h). The name's
  // next turn, if it waits here, enters negotiation.
  bool Take(const std::string& name, TensorEntry* out);
  // The input pointers of the pending entry `name` into *out; false if
  // there is none. They stay valid until the entry is taken.
  bool Inputs(const std::string& name, std::vector<const void*>* out) const;
  // Names of entries enqueued before `cutoff`, at most `limit` of them, and
  // how many there are in all.
  std::vector<std::string> EnqueuedBefore(std::chrono::steady_clock::time_point cutoff,
                                          size_t limit, size_t* total) const;
  // Removes every entry, waiting ones included, and returns them (to be
  // failed by the caller).
  std::vector<TensorEntry> TakeAll();

 private:
  // A name's turns (see Note [Same-name calls in flight]); erased when no
  // turn is reserved beyond the completed ones.
  struct Turns {
    uint64_t reserved = 0;                    // turns handed out
    uint64_t current = 0;                     // the turn that may negotiate now
    std::map<uint64_t, TensorEntry> waiting;  // later turns' entries
    std::set<uint64_t> cancelled;
  };
  // Admits the entry into negotiation. mu_ held.
  void AdmitLocked(TensorEntry entry);
  // Moves on past `name`'s completed or cancelled turns, admitting the
  // current one if it waits. mu_ held.
  void AdvanceLocked(const std::string& name);

  mutable std::mutex mu_;
  std::unordered_map<std::string, TensorEntry> entries_;
  std::vector<Request> new_requests_;
  std::unordered_map<std::string, Turns> turns_;
  int64_t released_ = 0;
};

}  // namespace hvdmx

#endif  // HVDMX_TENSOR_QUEUE_H_
