#include "algorithms/bruck.h"

#include <algorithm>
#include <cstring>

namespace hvdmx {
namespace {

// PostSendPieces or PostRecvPieces (comm/comm.h).
void PostPieces(DataComm& comm, bool send, char* buf, int64_t bytes, int peer,
                std::vector<DataComm::Request>* requests) {
  if (send) {
    PostSendPieces(comm, buf, bytes, peer, requests);
  } else {
    PostRecvPieces(comm, buf, bytes, peer, requests);
  }
}

void WaitAll(DataComm& comm, const std::vector<DataComm::Request>& requests) {
  for (DataComm::Request request : requests) comm.Wait(request);
}

// Posts the transfer of slots first, first + 1, ..., first + count - 1
// (mod n) of `slots`: at most two runs, split where the range wraps.
void PostSlots(DataComm& comm, bool send, char* slots, int64_t block_bytes, int first, int count,
               int n, int peer, std::vector<DataComm::Request>* requests) {
  const int run = std::min(count, n - first);
  PostPieces(comm, send, slots + first * block_bytes, run * block_bytes, peer, requests);
  if (run < count) PostPieces(comm, send, slots, (count - run) * block_bytes, peer, requests);
}

}  // namespace

void BruckAllgather(DataComm& comm, char* slots, int64_t block_bytes) {
  const int n = comm.size();
  const int me = comm.rank();
  std::vector<DataComm::Request> requests;
  for (int step = 1; step < n; step *= 2) {
    const int count = std::min(step, n - step);
    requests.clear();
    PostSlots(comm, /*send=*/false, slots, block_bytes, (me + step) % n, count, n, (me + step) % n,
              &requests);
    PostSlots(comm, /*send=*/true, slots, block_bytes, me, count, n, (me - step + n) % n,
              &requests);
    WaitAll(comm, requests);
  }
}

// Note [Bruck's alltoall]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Rank r numbers its blocks by distance: block i is the one for rank
// r + i (mod n). Step k sends to r + 2^k every block whose index has bit k
// set, in index order in one message, and receives from r - 2^k that
// rank's blocks of the same indices, which take their places. A block
// keeps its index and moves 2^k at each step whose bit its index has, so
// after the last step block i has moved i: it is at its destination, and
// at rank d the block of index i came from d - i. Before step k, the block
// of index i at rank r came from s = r - (i mod 2^k), for s + i: every rank
// knows its size from the matrix, so the receiver posts the exact size of
// every message, and a peer that sends another is caught by the transport.
//
// A block whose index has no bit above k is home after step k and is
// copied to `out` there and then; the blocks still on their way are kept
// in `held` (compacted at every step), so the scratch stays within about
// twice the alltoall's bytes at any n. Each rank sends about
// ceil(log2 n) / 2 times its bytes (each block moves once per bit of its
// index), where the direct exchange sends them once: the price of linking
// with 2 log2 n ranks instead of n - 1.
void Alltoall(DataComm& comm, const char* in, char* out, const std::vector<int64_t>& bytes,
              AlltoallScratch* scratch) {
  const int n = comm.size();
  const int me = comm.rank();
  auto size_of = [&](int from, int to) { return bytes[static_cast<size_t>(from) * n + to]; };
  std::vector<int64_t> in_at(n + 1, 0), out_at(n + 1, 0);
  for (int j = 0; j < n; ++j) {
    in_at[j + 1] = in_at[j] + size_of(me, j);
    out_at[j + 1] = out_at[j] + size_of(j, me);
  }
  std::vector<DataComm::Request> requests;
  if (comm.LinksEveryPair()) {
    // Every pair directly: all receives, then all sends, then this rank's
    // own block (the peers can start reading ours while we copy).
    for (int j = 0; j < n; ++j) {
      if (j != me) PostRecvPieces(comm, out + out_at[j], size_of(j, me), j, &requests);
    }
    for (int j = 0; j < n; ++j) {
      if (j != me) PostSendPieces(comm, in + in_at[j], size_of(me, j), j, &requests);
    }
    if (size_of(me, me)) std::memcpy(out + out_at[me], in + in_at[me], size_of(me, me));
    WaitAll(comm, requests);
    return;
  }
  // See Note [Bruck's alltoall]. where[i], length[i]: block i's bytes now.
  if (size_of(me, me)) std::memcpy(out + out_at[me], in + in_at[me], size_of(me, me));
  std::vector<const char*> where(n);
  std::vector<int64_t> length(n);
  std::vector<bool> in_input(n, true);  // where[i] points into `in`, not the scratch
  for (int i = 1; i < n; ++i) {
    const int to = (me + i) % n;
    where[i] = in + in_at[to];
    length[i] = size_of(me, to);
  }
  std::vector<int64_t> recv_at(n);
  for (int step = 1; step < n; step *= 2) {
    const int to = (me + step) % n, from = (me - step + n) % n;
    int64_t send_bytes = 0, recv_bytes = 0;
    for (int i = step; i < n; ++i) {
      if ((i & step) == 0) continue;
      send_bytes += length[i];
      // Block i at `from` came from s = from - (i mod step), for s + i.
      const int s = (from - (i & (step - 1)) + n) % n;
      recv_at[i] = recv_bytes;
      recv_bytes += size_of(s, (s + i) % n);
    }
    scratch->send.resize(static_cast<size_t>(send_bytes));
    scratch->recv.resize(static_cast<size_t>(recv_bytes));
    int64_t at = 0;
    for (int i = step; i < n; ++i) {
      if ((i & step) == 0 || length[i] == 0) continue;
      std::memcpy(scratch->send.data() + at, where[i], length[i]);
      at += length[i];
    }
    requests.clear();
    PostRecvPieces(comm, scratch->recv.data(), recv_bytes, from, &requests);
    PostSendPieces(comm, scratch->send.data(), send_bytes, to, &requests);
    WaitAll(comm, requests);
    // The blocks received are home (no bit above this step's) or kept on.
    int64_t held_bytes = 0;
    for (int i = step; i < n; ++i) {
      const bool moved = (i & step) != 0;
      if (moved) {
        const int s = (from - (i & (step - 1)) + n) % n;
        length[i] = size_of(s, (s + i) % n);
        where[i] = scratch->recv.data() + recv_at[i];
        in_input[i] = false;
      }
      if (i < 2 * step) {
        // Home: it came from me - i.
        if (moved && length[i]) std::memcpy(out + out_at[(me - i + n) % n], where[i], length[i]);
        continue;
      }
      if (!in_input[i]) held_bytes += length[i];
    }
    scratch->next.resize(static_cast<size_t>(held_bytes));
    at = 0;
    for (int i = 2 * step; i < n; ++i) {
      if (in_input[i]) continue;
      if (length[i]) std::memcpy(scratch->next.data() + at, where[i], length[i]);
      where[i] = scratch->next.data() + at;
      at += length[i];
    }
    std::swap(scratch->held, scratch->next);
  }
}

}  // namespace hvdmx
