// Bruck's allgather and alltoall (Bruck et al., "Efficient algorithms for
// all-to-all communications in multiport message-passing systems", 1997):
// every rank's blocks reach every other rank in ceil(log2 n) steps, step k
// talking only to the ranks r + 2^k and r - 2^k (mod n). They are how the
// collectives that would otherwise send from every rank to every other
// (the exchange allreduce, alltoall, finding Adasum's hosts) run over a
// comm that links each rank only with those (Note [The data comm's links]
// in comm/p2p_comm.h).
//
// Vocabulary. A block is what one rank has for one other (allgather: its
// own contribution; alltoall: what it sends to one destination). Step k
// (k = 0, 1, ... while 2^k < n) moves blocks a distance of 2^k.
//
// Threading: whoever owns `comm` (the runtime's background thread).
#ifndef HVDMX_BRUCK_H_
#define HVDMX_BRUCK_H_

#include <cstdint>
#include <vector>

#include "comm/comm.h"

namespace hvdmx {

// Allgather of equal blocks, in place: `slots` holds n blocks of
// `block_bytes` (rank j's at j * block_bytes), this rank's filled; on
// return all are. Step k receives from r + 2^k the blocks r + 2^k ...
// r + 2^k + c - 1, c = min(2^k, n - 2^k), and sends r ... r + c - 1 to
// r - 2^k, so that after it rank r holds r ... r + 2^(k+1) - 1. Each rank
// receives each other rank's block once: (n - 1) blocks, as a direct
// exchange does, in ceil(log2 n) latencies instead of one.
void BruckAllgather(DataComm& comm, char* slots, int64_t block_bytes);

// Buffers reused between alltoalls.
struct AlltoallScratch {
  std::vector<char> held;  // the blocks still on their way, between steps
  std::vector<char> next;
  std::vector<char> send;
  std::vector<char> recv;
};

// Alltoall of blocks of any size: bytes[i * n + j] is what rank i sends to
// rank j (every rank passes the same matrix, which the negotiation agreed
// on). `in` holds this rank's blocks for ranks 0, 1, ..., n-1 one after
// another; `out` receives the blocks from ranks 0, 1, ..., n-1 one after
// another. When the comm links every pair, every pair exchanges directly
// (one latency); otherwise Bruck's algorithm, as in Note [Bruck's
// alltoall] in bruck.cc. Either way each block arrives whole and unchanged,
// so the outputs are bitwise the same. Every message's size is known to
// its receiver from the matrix, and a peer that sends another fails the
// comm (PeerProtocolError naming it).
void Alltoall(DataComm& comm, const char* in, char* out, const std::vector<int64_t>& bytes,
              AlltoallScratch* scratch);

}  // namespace hvdmx

#endif  // HVDMX_BRUCK_H_
