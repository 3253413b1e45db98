// Small allreduces completed inside the negotiation round that finds them
// ready: their operands travel with the round's bit-and.
//
// Note [Small tensors in the round]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A small allreduce costs two trips through the network: the negotiation
// round that finds it ready on every rank, then its own exchange. When its
// request is a cache hit, every rank already knows the response (the cache
// is the same everywhere), so its operand can go with the round's bit-and,
// reduced as the bit-and's messages meet (BitAndReduction in
// comm/comm.h): if the AND then says its slot is ready on every rank, the
// combination holds every rank's operand and the unit is done, one network
// trip and no executor work instead of two.
//
// A rank's partial is one record per cache hit it holds whose response is
// an allreduce (not Adasum) of at most HVDMX_ROUND_ALLREDUCE_BYTES in all,
// in ascending slot order, while the partial stays within
// BitAndPartial::kMaxBytes: the slot (8 bytes), then each tensor's operand,
// prescaled (float16 and bfloat16 widened to float32, as Note [Half
// precision summed in float32] in algorithms/reduce_kernels.cc has them
// summed), each padded to a multiple of 8 bytes. A record's size follows
// from the cached response, so it is known to every rank without being
// sent. Combining two partials keeps the slots both hold and reduces their
// operands element by element: a slot survives only if every rank gave it.
// So a slot the AND makes ready that some rank left out (its limit is
// lower, its partial was full) is missing from the combination, which is
// the same bytes on every rank, and runs the usual way everywhere.
//
// A hit that waits for slower ranks is sent again every round; the limits
// bound what that costs. The reduction's order (the bit-and's, comm/
// p2p_collectives.cc) differs from the ring's or the exchange's, so a sum
// may round differently from what the usual path would give, as it does
// between algorithms; on every rank it is the same bits.
//
// Threading: the runtime's background thread, as the controller.
#ifndef HVDMX_ROUND_REDUCTION_H_
#define HVDMX_ROUND_REDUCTION_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "comm/peer_input.h"
#include "negotiation/response_cache.h"

namespace hvdmx {

// An allreduce the round completed (Note [Small tensors in the round]): its
// response, and its operands reduced over every rank, postscale not yet
// applied (RoundReduction::WriteOut).
struct ReducedUnit {
  Response response;
  std::string reduced;
};

class RoundReduction : public BitAndReduction {
 public:
  // `unit_bytes`: HVDMX_ROUND_ALLREDUCE_BYTES; 0 turns it off.
  RoundReduction(const ResponseCache& cache, int64_t unit_bytes)
      : cache_(cache), unit_bytes_(unit_bytes) {}

  bool enabled() const { return unit_bytes_ > 0; }
  // Whether the unit cached at `slot` goes with the round and its record
  // still fits after `partial_bytes` bytes of partial.
  bool Takes(int64_t slot, size_t partial_bytes) const;
  // Appends the record of the unit cached at `slot`, which Takes, to
  // *partial, reading its tensors at `inputs` (one per tensor).
  void Append(int64_t slot, const std::vector<const void*>& inputs, std::string* partial) const;
  // The operands of a combination, by slot (Check'ed already, or combined
  // here from partials that were; `from` as Combine's).
  std::map<int64_t, std::string> Records(const std::string& combined, const PeerSender& from) const;
  // Writes a unit's reduced operands to its outputs, postscaled by `post`
  // (Average's 1/size included), in each tensor's dtype.
  static void WriteOut(const Response& response, const std::string& reduced, double post,
                       const std::vector<void*>& outputs);

  std::string Combine(const std::string& low, const std::string& high,
                      const PeerSender& from) const override;
  void Check(const std::string& partial, const PeerSender& from) const override;

 private:
  struct Record {
    int64_t slot;
    size_t at;     // where its operands start in the partial
    size_t bytes;  // their size, padding included
  };
  // Whether the response at `slot` is an allreduce the round can carry,
  // whatever its size: the same answer on every rank.
  bool Carries(int64_t slot) const;
  // The records of `partial`, which `from` sent; throws PeerProtocolError
  // naming it and what is wrong (a slot out of order, not cached, not an
  // allreduce the round carries, or a record cut short).
  std::vector<Record> Parse(const std::string& partial, const PeerSender& from) const;
  // The bytes a record's operands take, padding included.
  size_t OperandBytes(const Response& response) const;

  const ResponseCache& cache_;
  int64_t unit_bytes_;
};

}  // namespace hvdmx

#endif  // HVDMX_ROUND_REDUCTION_H_
