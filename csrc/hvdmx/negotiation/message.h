// Requests (what one rank submitted) and responses (what every rank will
// run), and their wire form. Pure data and pure functions.
//
// One request or response is one negotiation unit: a single tensor, or all
// the tensors of a grouped call, which are negotiated and delivered together.
#ifndef HVDMX_MESSAGE_H_
#define HVDMX_MESSAGE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "base/common.h"
#include "comm/peer_input.h"

namespace hvdmx {

struct Request {
  int32_t rank = 0;
  CollectiveType type = CollectiveType::kAllreduce;
  std::string name;
  std::vector<DataType> dtypes;              // one per tensor
  std::vector<std::vector<int64_t>> shapes;  // one per tensor
  ReduceOp op = ReduceOp::kSum;
  int32_t root = 0;
  Scale scale;          // allreduce and reducescatter
  int32_t device = -1;  // -1: CPU; otherwise a GPU ordinal
  // Allgather and alltoall negotiate twice: first only the sizes (each
  // rank's dim 0, or its alltoall splits), at the call, so that the output
  // can be allocated; then the data, from the engine op. The sizes round
  // carries the name plus "#sizes", so the two rounds never share a name.
  bool sizes_only = false;
  // alltoall, sizes round: rows this rank sends to each rank. Data round of
  // allgather and alltoall: the sizes round's Response::splits.
  std::vector<int64_t> splits;
  // Set when this rank has waited HVDMX_STALL_SHUTDOWN_TIME_SECONDS for the
  // unit: rank 0 then fails it everywhere (see Note [Stall shutdown]).
  bool stalled = false;
  // Non-empty: the call failed on this rank before it could run (an array
  // it cannot read, see Note [oneDNN layout] in mxnet_engine.h). The
  // request still goes to the coordinator, which fails the unit on every
  // rank with this message once all have submitted it, instead of leaving
  // the others waiting. Never a cache hit.
  std::string error;

  // Same collective with the same parameters (ignores `rank` and `error`).
  bool SameParams(const Request& other) const;
};

struct Response {
  CollectiveType type = CollectiveType::kAllreduce;
  std::string name;
  std::vector<DataType> dtypes;
  std::vector<int64_t> counts;  // elements per tensor
  ReduceOp op = ReduceOp::kSum;
  int32_t root = 0;
  Scale scale;  // allreduce and reducescatter
  bool sizes_only = false;
  // allgather: dim 0 of tensor t on rank r at [t * size + r]; alltoall:
  // rows rank i sends to rank j at [i * size + j]. Empty for the others.
  std::vector<int64_t> splits;
  // Non-empty: the request failed on every rank with this message.
  std::string error;
};

int64_t ElementCount(const std::vector<int64_t>& shape);
// The bytes of every tensor of `response`'s unit, in all.
int64_t UnitBytes(const Response& response);

// Builds the response for a unit every rank has requested (requests in rank
// order, one per rank), or an error response naming the ranks and values
// that disagree.
Response MakeResponse(const std::vector<Request>& requests);

// An error response for `request`'s unit with `message`.
Response ErrorResponse(const Request& request, std::string message);

// The wire form. What a Parse reads came from a peer, `from`, in a comm of
// `size` ranks: each field is checked before it is used (Note [Peer input]
// in comm/peer_input.h) and the first that fails throws PeerProtocolError
// naming `from`, the field, its value and its bound. The bounds that no
// field states are these: a request list holds its sender's requests only
// (rank == from.rank); ranks and roots lie in [0, size); a unit has as many
// dtypes as shapes (requests) or counts (responses); a tensor's dimensions,
// a unit's elements in all, and every split lie in [0, kMaxWireElements];
// an alltoall's sizes request has `size` splits; a response's splits are
// the ones its collective reads (Response::splits), none for the others.
constexpr int64_t kMaxWireElements = int64_t{1} << 56;

std::string SerializeRequests(const std::vector<Request>& requests);
std::vector<Request> ParseRequests(const std::string& bytes, const PeerSender& from, int size);
// The same, each request with a cache slot (-1: none, else below
// `cache_capacity`), for requests sent with the bit-and (Note [Requests
// with the bit-and] in controller.h). `slots` has one per request.
std::string SerializeRequests(const std::vector<Request>& requests,
                              const std::vector<int64_t>& slots);
std::vector<Request> ParseRequests(const std::string& bytes, const PeerSender& from, int size,
                                   int64_t cache_capacity, std::vector<int64_t>* slots);
// A response list, or instead the coordinator's finding that rank `rank`
// sent what the protocol does not allow (`message`, the PeerProtocolError
// rank 0 raised): ParseResponses then throws that error, naming `rank`, on
// every rank that reads it.
std::string SerializeResponses(const std::vector<Response>& responses);
std::string SerializePeerFailure(int rank, const std::string& message);
std::vector<Response> ParseResponses(const std::string& bytes, const PeerSender& from, int size);
// Throws PeerProtocolError naming `from` (the coordinator) when `response`,
// a successful one for this rank's `mine`, does not fit it: another
// collective, other dtypes, another number of tensors, or, where every
// rank's tensors have one shape (all but allgather and alltoall), other
// element counts. The executor sizes this rank's buffers by the response.
void CheckResponseFits(const Request& mine, const Response& response, const PeerSender& from);

}  // namespace hvdmx

#endif  // HVDMX_MESSAGE_H_
