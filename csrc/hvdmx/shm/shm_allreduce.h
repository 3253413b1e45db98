// An allreduce for ranks that share one host, through memory that all of
// them have mapped (shm_segment.h maps it over MPI; tests use plain memory
// and one thread per rank). No MPI call is made here.
//
// Vocabulary. Each rank owns a region of the shared memory: three counters
// (copied, reduced, done), then kStages stages of `chunk_bytes` each (plus a
// page: see Note [Where a chunk sits in its stage] in the .cc). The
// message of `count` elements (one buffer, or the concatenation of a fused
// call's Spans: "the buffer" below) is cut into chunks of at most
// chunk_bytes (the same cut on every rank); chunk k of a call travels
// through stage (seq % kStages), where seq numbers chunks over all calls
// since creation.
// A chunk is cut into `size` slices (ShmSliceStart); rank j reduces slice j.
//
// One chunk, on rank r, in three phases:
// - copy in: r copies every slice of its chunk except slice r into its own
//   stage, then publishes copied = seq + 1;
// - reduce: once every peer has copied, r reduces slice r over all ranks in
//   rank order 0, 1, ..., size-1 (its own operand straight from its buffer)
//   into slice r of its own stage, scales it by the call's postscale and
//   copies it into its buffer (block by block, while the block is in
//   cache); publishes reduced;
// - copy out: for each peer j, once j has reduced, r copies slice j of j's
//   stage into its buffer; publishes done.
// A stage is written again (chunk seq + kStages) only after every rank has
// published done for seq. Ranks run reduce(k), copy in(k+1), copy out(k), so
// each wait has a phase of slack: peers copy chunk k+1 in while r reduces k.
//
// Bytes. Per rank and message of S bytes: (n-1)/n S copied in, S/n reduced
// from n operands, S/n copied to the buffer from cache, (n-1)/n S copied out.
// The stages are small (n * kStages * chunk_bytes in all), so the shared
// bytes stay in the caches and memory sees about one read and one write of
// the buffer.
//
// Stores. A call may write its stages with streaming stores: the
// allreduce's copy in and its reduced slice (reduced into a scratch block,
// then copied to the buffer and streamed to the stage), the byte-moving
// calls' and the reduce-scatter's copy in, and the writes into peers'
// outputs. Under StageStores::kAuto only calls of at least
// StageStoreChooser::kMinBytes may, the allreduce and each kind of
// byte-moving call choosing apart (through the stages and into peers'
// outputs apart too); see Note [Streaming stores into the stages] in
// stage_stores.h. A hierarchical allreduce always uses
// cached stores.
//
// Bitwise identical results: every element is reduced once, by one rank, in
// one fixed order (rank 0 first), with the kernels of reduce_kernels.h, and
// then copied; every rank ends with the same bits.
//
// float16 and bfloat16 are reduced in float32 (Note [Half precision summed
// in float32] in reduce_kernels.cc): the reducing rank widens every rank's
// operand (times the prescale), combines them in float32 a block at a time
// and rounds once, after the postscale. Nothing else changes: the stages
// carry the dtype's bytes.
//
// Across hosts (hierarchical allreduce): given a `cross` allreduce that
// joins this rank with the ranks of the same local rank on the other hosts
// (every host with the same number of ranks), the reduce phase runs it on
// the slice it has just reduced for its host, before publishing it. A half
// dtype's host sums go to it in float32, and it rounds the result. Each
// rank of a host thus works on its own shard across hosts, and the copy-out
// spreads the job-wide result inside the host. The results stay bitwise
// identical if `cross` gives identical bits on all its ranks (the ring does).
//
// Moving bytes (broadcast, allgather, alltoall), one host only: each rank
// publishes a stream of bytes (its block) through its stages, chunk k of
// every stream in chunk seq, and reads the ranges it needs from its peers'
// stages straight into its output. The counters keep their meaning (copied:
// this rank's chunk is in its stage; done: it has read what it needs of
// chunk seq), so these calls and Allreduce interleave in any order, the same
// on every rank. Per rank and call: its block copied in once, what it
// receives copied out once; nothing is allocated. A call whose longest
// stream has at least `direct_min_bytes` skips the stages: see Note [Reading
// peers' buffers directly] in shm_exchange.cc. ReduceScatter uses the
// same stages and counters (see its comment). These calls are in
// shm_exchange.cc; the allreduce and the bit-and in shm_allreduce.cc.
//
// Waiting: see Note [Waiting in shared memory] in shm_internal.h.
//
// Threading: an ShmAllreduce belongs to one rank and is used by one thread
// at a time. All ranks must call Allreduce in the same order with the same
// count, dtype and op.
#ifndef HVDMX_SHM_ALLREDUCE_H_
#define HVDMX_SHM_ALLREDUCE_H_

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "base/common.h"
#include "comm/comm.h"
#include "platform/huge_pages.h"
#include "platform/stage_stores.h"

namespace hvdmx {

// First element of slice j when a chunk of `len` elements is cut into n
// slices of whole `unit`s (the last may be shorter); slices past the end are
// empty. ShmSliceStart(len, n, 0, u) == 0 and ShmSliceStart(len, n, n, u) == len.
int64_t ShmSliceStart(int64_t len, int n, int j, int64_t unit);

// Note [A peer that stops]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A rank whose runtime stops (a stall shutdown, a peer's failure, its own
// hvd.shutdown()) sets `stopped` in its control block, and a rank whose
// process ends without that is seen through its pid (kill(pid, 0) fails with
// ESRCH; asked at most every kPidCheckMicros per peer). Every wait in shared
// memory, and the bit-and's Test, ask about the peer they wait for once they
// sleep; a peer that is gone and has not written what the wait needs makes
// the call throw ShmPeerGone. The runtime then fails what it was running and
// what is pending, and stops in turn (runtime.h), so hvd.shutdown() and the
// process's exit never wait for a peer that will not come. A clean shutdown
// stops every rank after the same round, whose writes every peer has made
// before it marks itself stopped, so no wait of that round throws.
// peer() is the peer's rank among the host's ranks.
class ShmPeerGone : public PeerGone {
 public:
  using PeerGone::PeerGone;
};

class ShmAllreduce {
 public:
  static constexpr int kStages = 4;
  static constexpr int64_t kDirectAuto = -2;
  // Under kDirectAuto, alltoalls and broadcasts whose longest stream has at
  // least this many bytes are read directly. At np=2, alltoalls of 16 MiB
  // and up were 1.1-1.4x faster than through the stages, broadcasts
  // (the root writing half of the peer's output, Note [Reading peers'
  // buffers directly]) 1.2-2.3x; at 4 MiB both were mixed
  // (docs/benchmark-notes.md, "Single-copy moves and huge pages" and
  // "Broadcasts read directly, the root writing half"). Allgathers were
  // mixed read directly; most write
  // into the peers' outputs instead.
  static constexpr int64_t kAutoDirectMinBytes = int64_t{8} << 20;
  // Under StageStores::kAuto, a write into the peers' outputs (Note
  // [Writing into peers' outputs]) may stream from this many bytes written
  // by the rank, and smaller ones stay cached. At np=2 here, streaming made
  // 16 and 64 MiB allgathers and alltoalls 1.15-1.5x faster, and those of
  // 1-4 MiB 1.2-1.9x slower (they stay in the 32 MiB L3); 8 and 12 MiB were
  // mixed (docs/benchmark-notes.md, "Streaming stores into the peers'
  // outputs").
  // A choice among sizes that stay in cache would only pay for its trials.
  static constexpr int64_t kPushStreamMinBytes = int64_t{8} << 20;
  // An in-place allreduce of `count` elements among the ranks of one local
  // rank on every host (the same calls on all of them). For a half dtype,
  // `wide` holds this rank's operands in float32 and the result, multiplied
  // by `postscale` and rounded once, lands in `buf` (`wide` is clobbered);
  // otherwise `wide` is null, `postscale` is 1 and the result is in `buf`.
  using CrossAllreduce = std::function<void(void* buf, float* wide, int64_t count, DataType dtype,
                                            ReduceOp op, double postscale)>;

  // Bytes of one rank's region for a chunk size (rounded as the constructor
  // rounds it).
  static int64_t RegionBytes(int64_t chunk_bytes);
  // chunk_bytes rounded down to a multiple of 64, at least 64.
  static int64_t RoundChunkBytes(int64_t chunk_bytes);

  // `rank` and `size` are this rank's place among the ranks of its host.
  // `regions[j]` is local rank j's region as mapped in this process,
  // RegionBytes long, 64-byte aligned and zero before any rank's first call.
  // `owner` keeps the mapping alive as long as this object. `cross`, empty
  // on a single host, makes the allreduce hierarchical (see above).
  // `direct_min_bytes` >= 0: byte-moving calls whose longest stream has at
  // least that many bytes read the peers' buffers directly, which needs
  // CrossMemoryAttachWorks() between all of them; kDirectAuto: alltoalls
  // and broadcasts from kAutoDirectMinBytes, allgathers never; -1: never. The
  // same on every rank. `stores`: how the calls write their stages (may
  // differ between ranks). `huge_pages`: whether direct exchanges collapse
  // their streams first (Note [Huge pages under what peers read]).
  ShmAllreduce(int rank, int size, std::vector<char*> regions, int64_t chunk_bytes,
               std::shared_ptr<void> owner, CrossAllreduce cross = nullptr,
               int64_t direct_min_bytes = -1, StageStores stores = StageStores::kAuto,
               bool huge_pages = true);
  ShmAllreduce(const ShmAllreduce&) = delete;
  ShmAllreduce& operator=(const ShmAllreduce&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int64_t chunk_bytes() const { return chunk_bytes_; }
  bool hierarchical() const { return static_cast<bool>(cross_); }
  // Calls made so far, and the calls of every kind (exchanges too) that
  // wrote their stages with streaming stores; any thread may read them.
  int64_t calls() const { return calls_.load(std::memory_order_relaxed); }
  int64_t streamed_calls() const { return streamed_calls_.load(std::memory_order_relaxed); }
  StageStores stage_stores() const { return stores_.stores(); }

  // Allreduces `buf` (count elements of dtype) in place with `op` (kAverage
  // reduces as kSum), then multiplies the result by `postscale`: each block
  // as soon as it is reduced, while it is in cache, with the bits that
  // ScaleBuffer on the result would give. For a half dtype, the operands are
  // multiplied by `prescale` and everything is computed in float32 and
  // rounded once; other dtypes take prescale 1 (the caller scales them).
  void Allreduce(void* buf, int64_t count, DataType dtype, ReduceOp op, double postscale = 1.0,
                 double prescale = 1.0);
  // `count` elements at `data`: one tensor of a fused allreduce. Out of
  // place, `in` is where its input is (read, never written) and the result
  // lands in `data`; nullptr: in place.
  struct Span {
    void* data;
    int64_t count;
    const void* in = nullptr;
  };
  // Allreduces the concatenation of `spans` in place, as if they were one
  // buffer: a fused allreduce with no fusion buffer. The chunks and slices
  // are cut from the concatenation, so a chunk may take pieces of several
  // tensors, and the bits are those of one Allreduce on the concatenated
  // buffer. Every rank passes spans of the same counts.
  void Allreduce(const std::vector<Span>& spans, DataType dtype, ReduceOp op,
                 double postscale = 1.0, double prescale = 1.0);

  // The byte-moving calls below need a single host (not hierarchical()).
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
  // Reduce-scatter: elements [starts[j], starts[j+1]) of every rank's `in`,
  // reduced with `op` in rank order (kAverage as kSum) and multiplied by
  // `postscale`, land in `out` on rank j (starts: size + 1 element offsets,
  // the same on every rank). Chunk k carries a slot of the same number of
  // elements from every rank's block j, and rank j reduces its slot straight
  // from its input and its peers' stages into `out`: per rank, the other
  // ranks' blocks are copied in once and nothing is copied out. Needs
  // ReduceScatterFits(dtype): a chunk holds at least one element per rank.
  bool ReduceScatterFits(DataType dtype) const;
  void ReduceScatter(const void* in, void* out, const std::vector<int64_t>& starts,
                     DataType dtype, ReduceOp op, double postscale);
  // Byte-moving calls made so far, and those of them that read the peers'
  // buffers directly; any thread may read them.
  int64_t exchanges() const { return exchanges_.load(std::memory_order_relaxed); }
  int64_t direct_exchanges() const { return direct_exchanges_.load(std::memory_order_relaxed); }
  // Direct broadcasts in which this rank, their root, wrote part of the
  // peers' outputs (Note [Reading peers' buffers directly]).
  int64_t root_writes() const { return root_writes_.load(std::memory_order_relaxed); }
  // Huge pages this rank has collapsed under the streams its peers read
  // directly, and those the kernel refused; any thread may read them.
  int64_t collapsed_huge_pages() const { return huge_pages_.collapsed(); }
  int64_t refused_huge_pages() const { return huge_pages_.refused(); }
  int64_t direct_min_bytes() const { return direct_min_bytes_; }

  // Lets allgathers and alltoalls write each rank's rows straight into its
  // peers' outputs (Note [Writing into peers' outputs] in shm_exchange.cc)
  // when every rank's output lies in its shared output file: `arenas[j]` is
  // local rank j's file as mapped in this process, `arena_bytes` long.
  // Tried only by calls where every rank's output has at least
  // `min_output_bytes` (> 0; smaller outputs are never in the file). Called on
  // every rank or none, before the first call.
  void WriteIntoPeers(std::vector<char*> arenas, int64_t arena_bytes, int64_t min_output_bytes);
  bool writes_into_peers() const { return !arenas_.empty(); }
  // Byte-moving calls that wrote into the peers' outputs; any thread may read it.
  int64_t push_exchanges() const { return push_exchanges_.load(std::memory_order_relaxed); }

  // Whether this process can read `bytes` at `address` in process `pid`
  // with cross-memory attach (process_vm_readv: Linux, the same user, and
  // ptrace allowed between the two) and finds `expected` there, and can
  // write those bytes to `writable` there (process_vm_writev, which direct
  // broadcasts use). On failure, *why says what the kernel said.
  static bool CrossMemoryAttachWorks(int64_t pid, const void* address, const void* expected,
                                     void* writable, int64_t bytes, std::string* why);

  // A bitwise AND of `n` words over the host's ranks, split like
  // Comm::StartBitAnd / TestBitAnd (the negotiation's one collective per
  // round): Start publishes this rank's words, Test returns true once every
  // rank has published, with the AND in `words`. One may be outstanding at
  // a time; n <= kMaxBitAndWords. Independent of the other calls: it has
  // its own counter and words in each rank's control block.
  static constexpr int kMaxBitAndWords = 192;
  // `payload` (at most kMaxPayloadBytes) travels with the words: once Test
  // has returned true, BitAndPayload(j) is what rank j started this bit-and
  // with, until this rank's next Start (see Note [Negotiation through
  // shared memory]).
  static constexpr int64_t kMaxPayloadBytes = 32 * 1024;
  void StartBitAnd(uint64_t* words, int n, const std::string& payload = std::string());
  bool TestBitAnd();
  std::string BitAndPayload(int j) const;
  // Bit-ands completed so far; any thread may read it.
  int64_t bit_ands() const { return bit_ands_.load(std::memory_order_relaxed); }
  // Comm::BcastString of at most kMaxPayloadBytes, through the root's
  // control block: every rank calls it, in the same order, and gets true
  // once *data holds the root's string, or false, having changed nothing,
  // when the root's is longer (then every rank must broadcast it another
  // way). Independent of the other calls, as the bit-and is.
  bool BcastString(std::string* data, int root);
  // BcastStrings that went through shared memory; any thread may read it.
  int64_t strings_broadcast() const { return strings_broadcast_.load(std::memory_order_relaxed); }

  // Tells the peers that this rank will make no more calls (Note [A peer
  // that stops]). Idempotent; the destructor calls it too.
  void MarkStopped();
  ~ShmAllreduce();

 private:
  struct Call;
  struct Control;

  Control& control(int j) const;
  // Waits until peer j's `counter` >= `target`; throws ShmPeerGone if j
  // stops or dies first (Note [A peer that stops]).
  void Await(int j, const std::atomic<uint64_t>& counter, uint64_t target);
  // Why peer j will write no more (it stopped, or its process is gone);
  // empty while it may.
  std::string PeerGoneReason(int j);
  // Throws ShmPeerGone if peer j is gone and `counter` still falls short of
  // `target`.
  void ThrowIfGone(int j, const std::atomic<uint64_t>& counter, uint64_t target);
  static constexpr int64_t kPidCheckMicros = 100000;
  // Rank j's mailbox i: 0 and 1 hold bit-and payloads, 2 and 3 broadcast
  // strings; kMaxPayloadBytes each, after its Control block.
  char* Mailbox(int j, int i) const;
  char* Stage(int j, uint64_t seq) const;
  // This rank's stage for chunk seq, once every peer is done with the chunk
  // it held before, placed for a copy from `src`.
  char* ClaimStage(uint64_t seq, const char* src);
  // Calls f(data, in, at, bytes) for each piece of elements [lo, hi) of the
  // call's concatenated spans, in order: `data` is where the piece's result
  // goes, `in` where its input is (`data` in place), `at` its distance in
  // bytes from element lo.
  template <typename F>
  void ForPieces(const Call& call, int64_t lo, int64_t hi, F&& f) const;
  void CopyIn(const Call& call, int64_t k);
  void Reduce(const Call& call, int64_t k);
  void CopyOut(const Call& call, int64_t k);
  // operands_[0..size) reduced in rank order into `out` (n elements),
  // multiplied by `scale`; a half dtype's in float32, each operand times
  // `prescale`, rounded once.
  void ReduceOperands(char* out, int64_t n, DataType dtype, ReduceOp op, double scale,
                      double prescale = 1.0);
  // A half dtype's operands_, from element `first`, each times `prescale`,
  // reduced in rank order in float32 into acc (n elements).
  void ReduceOperandsWide(float* acc, int64_t first, int64_t n, DataType dtype, ReduceOp op,
                          double prescale) const;
  // A copy into this rank's stage, with the current call's stores.
  void StageCopy(char* dst, const char* src, int64_t bytes) const;
  // Releases `value` in one of this rank's counters, after the current
  // call's streaming stores (weakly ordered) if it streams.
  void PublishOwn(std::atomic<uint64_t>& counter, uint64_t value) const;
  // Runs body() (one call's chunks) with the stores `chooser` picks for a
  // call of `bytes`, and tells it how long that took; with !choose, with
  // cached stores and untimed. Defined in shm_internal.h.
  template <typename F>
  void WithStores(StageStoreChooser& chooser, int64_t bytes, bool choose, F&& body);
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
  enum Move { kBroadcast = 0, kAllgather, kAlltoall, kReduceScatter, kMoves };
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

  const int rank_;
  const int size_;
  const std::vector<char*> regions_;
  const int64_t chunk_bytes_;
  std::shared_ptr<void> owner_;
  const CrossAllreduce cross_;
  uint64_t seq_ = 0;  // chunks this rank has finished, over all calls
  std::vector<const char*> operands_;  // Reduce's, one per rank
  std::vector<char*> slices_;          // Reduce's, one per rank
  std::vector<Span> one_span_;         // the one-buffer Allreduce's spans
  std::vector<int64_t> span_starts_;   // first element of each span, then the total
  const int64_t spin_micros_;          // see Note [Waiting in shared memory]
  std::atomic<int64_t> calls_{0};
  std::atomic<int64_t> streamed_calls_{0};
  std::atomic<int64_t> exchanges_{0};
  std::atomic<int64_t> direct_exchanges_{0};
  std::atomic<int64_t> root_writes_{0};
  HugePageCollapser huge_pages_;  // under direct exchanges' streams
  const int64_t direct_min_bytes_;
  StageStoreChooser stores_;  // the allreduce's
  std::array<StageStoreChooser, kMoves> move_stores_;
  std::array<StageStoreChooser, kMoves> push_stores_;  // writes into peers' outputs
  bool streaming_ = false;     // the current call's stores
  std::vector<char> scratch_;  // Reduce's block when streaming
  // A half dtype's float32 partials: ReduceOperands' (kWideBlockElems), or
  // when hierarchical a slice's host sums (a chunk's elements).
  std::vector<float> wide_;
  std::atomic<int64_t> bit_ands_{0};
  uint64_t bit_and_seq_ = 0;        // bit-ands this rank has started
  uint64_t* bit_and_words_ = nullptr;
  int bit_and_count_ = 0;
  uint64_t bcast_calls_ = 0;  // BcastStrings this rank has made
  std::atomic<int64_t> strings_broadcast_{0};
  std::vector<Read> reads_;        // Exchange's input, one per rank
  std::vector<int64_t> lengths_;   // Exchange's input: the streams' lengths
  std::vector<Send> sends_;        // Exchange's input for a push, one per rank
  Output out_;                     // Exchange's input for a push
  std::vector<char*> arenas_;      // see WriteIntoPeers; empty: no push
  int64_t arena_bytes_ = 0;
  int64_t push_min_output_bytes_ = 0;
  std::atomic<int64_t> push_exchanges_{0};
  std::vector<std::chrono::steady_clock::time_point> next_pid_check_;  // per peer
};

}  // namespace hvdmx

#endif  // HVDMX_SHM_ALLREDUCE_H_
