// The byte-moving collectives (broadcast, allgather, alltoall) of ranks
// that share one host, through the stages of a ShmRegion (shm_region.h
// fixes the vocabulary), or straight between the ranks' buffers. No MPI
// call is made here.
//
// Moving bytes (broadcast, allgather, alltoall), one host only: each rank
// publishes a stream of bytes (its block) through its stages, chunk k of
// every stream in chunk seq, and reads the ranges it needs from its peers'
// stages straight into its output. The counters keep their meaning (copied:
// this rank's chunk is in its stage; done: it has read what it needs of
// chunk seq), so these calls and ShmAllreduce's interleave in any order, the same
// on every rank. Per rank and call: its block copied in once, what it
// receives copied out once; nothing is allocated. A call whose longest
// stream has at least `direct_min_bytes` skips the stages: see Note [Reading
// peers' buffers directly] in shm_exchange_direct.cc; a call whose
// outputs all lie in the ranks' shared output files may write into them
// instead: see Note [Writing into peers' outputs] in shm_exchange_push.cc.
// The reduce-scatter is ShmAllreduce's (it reduces).
//
//
// Stores. The calls' copies into the stages, and the writes into peers'
// outputs, may use streaming stores: under StageStores::kAuto only calls of
// at least StageStoreChooser::kMinBytes, each kind of call choosing apart
// (through the stages and into peers' outputs apart too); see Note
// [Streaming stores into the stages] in stage_stores.h.
//
// Threading: an ShmExchange belongs to one rank and is used by one thread
// at a time. All ranks make the same calls in the same order.
#ifndef HVDMX_SHM_EXCHANGE_H_
#define HVDMX_SHM_EXCHANGE_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "platform/huge_pages.h"
#include "platform/stage_stores.h"
#include "shm/shm_region.h"

namespace hvdmx {

class ShmExchange {
 public:
  static constexpr int64_t kDirectAuto = -2;
  // Under kDirectAuto, alltoalls and broadcasts whose longest stream has at
  // least this many bytes are read directly: from there on, alltoalls and
  // broadcasts (the root writing half of the peer's output, Note [Reading
  // peers' buffers directly]) were faster than through the stages, and at
  // half of it mixed (docs/benchmark-notes.md, "Single-copy moves and huge
  // pages" and "Broadcasts read directly, the root writing half").
  // Allgathers were mixed read directly; most write into the peers' outputs
  // instead.
  static constexpr int64_t kAutoDirectMinBytes = int64_t{8} << 20;
  // Under StageStores::kAuto, a write into the peers' outputs (Note
  // [Writing into peers' outputs]) may stream from this many bytes written
  // by the rank, and smaller ones stay cached: streaming made larger
  // allgathers and alltoalls faster and those that stay in the last-level
  // cache slower, with this size in between (docs/benchmark-notes.md,
  // "Streaming stores into the peers' outputs").
  // A choice among sizes that stay in cache would only pay for its trials.
  static constexpr int64_t kPushStreamMinBytes = int64_t{8} << 20;

  // `region` outlives this object. The calls need `single_host` (a
  // hierarchical job moves bytes with MPI). `direct_min_bytes` >= 0: calls
  // whose longest stream has at least that many bytes read the peers'
  // buffers directly, which needs CrossMemoryAttachWorks() between all of
  // them; kDirectAuto: alltoalls and broadcasts from kAutoDirectMinBytes,
  // allgathers never; -1: never. The same on every rank. `stores`: how the
  // calls write their stages (may differ between ranks). `huge_pages`:
  // whether direct exchanges collapse their streams first (Note [Huge pages
  // under what peers read]).
  ShmExchange(ShmRegion* region, bool single_host, int64_t direct_min_bytes = -1,
              StageStores stores = StageStores::kAuto, bool huge_pages = true);
  ShmExchange(const ShmExchange&) = delete;
  ShmExchange& operator=(const ShmExchange&) = delete;

  // `root`'s `bytes` of `in` land in `out` on every rank (`in` is read on
  // the root only; it may be `out`). Out of place, the root copies each chunk
  // to its output as it publishes it, while the chunk is in cache.
  void Broadcast(const void* in, void* out, int64_t bytes, int root);
  // Rank j's block, `in` on rank j, lands at out[starts[j], starts[j+1]) on
  // every rank (starts: size + 1 byte offsets, the same on every rank).
  // `in` may be out + starts[rank] itself.
  void Allgather(const void* in, void* out, const std::vector<int64_t>& starts);
  // Rank i sends bytes[i * size + j] bytes to rank j: `in` holds them in
  // rank order of j, and `out` receives them in rank order of i.
  void Alltoall(const void* in, void* out, const std::vector<int64_t>& bytes);
  // Huge pages this rank has collapsed under the streams its peers read
  // directly, and those the kernel refused; any thread may read them.
  int64_t collapsed_huge_pages() const { return huge_pages_.collapsed(); }
  int64_t refused_huge_pages() const { return huge_pages_.refused(); }
  int64_t direct_min_bytes() const { return direct_min_bytes_; }

  // Lets allgathers and alltoalls write each rank's rows straight into its
  // peers' outputs (Note [Writing into peers' outputs] in shm_exchange_push.cc)
  // when every rank's output lies in its shared output file: `arenas[j]` is
  // local rank j's file as mapped in this process, `arena_bytes` long.
  // Tried only by calls where every rank's output has at least
  // `min_output_bytes` (> 0; smaller outputs are never in the file). Called on
  // every rank or none, before the first call.
  void WriteIntoPeers(std::vector<char*> arenas, int64_t arena_bytes, int64_t min_output_bytes);
  bool writes_into_peers() const { return !arenas_.empty(); }

  // Whether this process can read `bytes` at `address` in process `pid`
  // with cross-memory attach (process_vm_readv: Linux, the same user, and
  // ptrace allowed between the two) and finds `expected` there, and can
  // write those bytes to `writable` there (process_vm_writev, which direct
  // broadcasts use). On failure, *why says what the kernel said.
  static bool CrossMemoryAttachWorks(int64_t pid, const void* address, const void* expected,
                                     void* writable, int64_t bytes, std::string* why);

 private:
  // What a rank reads of one rank's stream: bytes [offset, offset + bytes)
  // of it, to dst. Its own read is of the stream's bytes, hole included.
  struct Read {
    int64_t offset = 0;
    int64_t bytes = 0;
    char* dst = nullptr;
  };
  // What this rank publishes: `data` without [hole_at, hole_at + hole_bytes)
  // (alltoall's rows for itself, which only it reads).
  struct Stream {
    const char* data = nullptr;
    int64_t hole_at = 0;
    int64_t hole_bytes = 0;
  };
  // Which call an exchange serves: each kind has its own StageStoreChooser.
  enum Move { kBroadcast = 0, kAllgather, kAlltoall, kMoves };
  // Rank j publishes lengths_[j] bytes (this rank: `stream`, hole removed);
  // this rank reads reads_[j] of rank j's. The caller fills both; lengths_
  // is the same on every rank.
  void Exchange(Move move, const Stream& stream);
  // Where `move`'s direct reads start (-1: never); see the constructor.
  int64_t DirectMinBytes(Move move) const;
  // Exchange without the stages: see Note [Reading peers' buffers directly].
  void ExchangeDirect(Move move, const Stream& stream);
  // The bytes at the end of a peer's `read_bytes`-long read of a direct
  // broadcast that the root writes into it: 1/size of it, in whole cache
  // lines.
  int64_t RootWrittenBytes(int64_t read_bytes) const;
  // What this rank writes into rank j's output in a push: `bytes` from
  // `src`, at `at` in the output. sends_[rank] is its own rows.
  struct Send {
    const char* src = nullptr;
    int64_t bytes = 0;
    int64_t at = 0;
  };
  // The current call's output on this rank, and the smallest on any rank;
  // data is nullptr for calls that never push.
  struct Output {
    char* data = nullptr;
    int64_t bytes = 0;
    int64_t min_bytes = 0;
  };
  // Exchange by writing into the peers' outputs (sends_, out_): see Note
  // [Writing into peers' outputs]. Returns false, having moved nothing,
  // when some rank's output is not in its shared file.
  bool ExchangePush(Move move);
  // Where `bytes` at `data` lie in this rank's shared output file, or -1
  // (also when there is none).
  int64_t OffsetInFile(const char* data, int64_t bytes) const;
  void Publish(const Stream& stream, int64_t length, uint64_t seq, int64_t k);
  void Collect(const Stream& stream, uint64_t seq, int64_t k);

  ShmRegion* const region_;
  const int rank_;
  const int size_;
  const int64_t chunk_bytes_;
  const bool single_host_;
  HugePageCollapser huge_pages_;  // under direct exchanges' streams
  const int64_t direct_min_bytes_;
  std::array<StageStoreChooser, kMoves> move_stores_;
  std::array<StageStoreChooser, kMoves> push_stores_;  // writes into peers' outputs
  std::vector<Read> reads_;                            // Exchange's input, one per rank
  std::vector<int64_t> lengths_;                       // Exchange's input: the streams' lengths
  std::vector<Send> sends_;                            // Exchange's input for a push, one per rank
  Output out_;                                         // Exchange's input for a push
  std::vector<char*> arenas_;                          // see WriteIntoPeers; empty: no push
  int64_t arena_bytes_ = 0;
  int64_t push_min_output_bytes_ = 0;
};

}  // namespace hvdmx

#endif  // HVDMX_SHM_EXCHANGE_H_
