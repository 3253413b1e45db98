"""The shared-memory allreduce in one process: one thread per rank over plain
memory, any number of ranks, no MPI (csrc/hvdmx/shm/shm_allreduce.h)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import _hvdmx_testing

from core_codes import DTYPE_CODES, REDUCE_OPS
from rank_data import mixed
FLOAT32, FLOAT64, FLOAT16, UINT8, INT32, INT8, INT64, BFLOAT16 = (DTYPE_CODES[name] for name in (
    "float32", "float64", "float16", "uint8", "int32", "int8", "int64", "bfloat16"))
# The numpy type that holds each code; bfloat16 travels as its bits.
HOLDER = {FLOAT32: np.float32, FLOAT64: np.float64, FLOAT16: np.float16, UINT8: np.uint8,
          INT32: np.int32, INT8: np.int8, INT64: np.int64, BFLOAT16: np.uint16}
SUM, MIN, MAX, PRODUCT = (REDUCE_OPS[name] for name in ("Sum", "Min", "Max", "Product"))
# Chunk sizes: the 64-byte minimum (many chunks, most slices empty), odd
# multiples of it, one page, and the default.
CHUNKS = [64, 128, 192, 4096, 256 * 1024]
MAX_BIT_AND_WORDS = 192  # ShmAllreduce::kMaxBitAndWords
# How the allreduce writes its stages (StageStores): auto, cached, streaming.
AUTO, CACHED, STREAMING = 0, 1, 2
STORES = [AUTO, CACHED, STREAMING]


def to_holder(values, code):
    """Small integers (exact in every type) as the code's numpy holder."""
    if code == BFLOAT16:
        return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return values.astype(HOLDER[code])


def from_holder(array, code):
    if code == BFLOAT16:
        return (array.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return array.astype(np.float64)


def inputs(size, count, code, op, seed=0):
    if op == PRODUCT:
        return [to_holder(1 + mixed(r, count, salt=seed, modulus=2), code) for r in range(size)]
    return [to_holder(mixed(r, count, salt=seed), code) for r in range(size)]


def reference(arrays, code, op):
    stacked = np.stack([from_holder(a, code) for a in arrays])
    fn = {SUM: np.sum, MIN: np.min, MAX: np.max, PRODUCT: np.prod}[op]
    return to_holder(fn(stacked, axis=0), code)


def run(calls, code, op, chunk, hosts=1, stores=AUTO):
    """Reduces calls[c][r] (rank r's array in call c) in place, call by call;
    returns the calls each rank streamed."""
    return _hvdmx_testing.shm_allreduce([[[a] for a in arrays] for arrays in calls], code, op,
                                        chunk, hosts=hosts, stores=stores)


def streamed_calls_wanted(stores, size, hosts, counts):
    """What each rank's streamed-calls count must be: forced streaming streams
    every call that reduces something (on one host, of more than one rank);
    the tests' calls are all below StageStoreChooser::kMinBytes (64 KiB),
    which auto keeps cached."""
    if stores != STREAMING or hosts > 1 or size == 1:
        return [0] * size
    return [sum(1 for count in counts if count > 0)] * size


@settings(max_examples=80, deadline=None)
@given(size=st.integers(1, 7), counts=st.lists(st.integers(0, 300), min_size=1, max_size=4),
       chunk=st.sampled_from(CHUNKS), code=st.sampled_from(sorted(HOLDER)),
       op=st.sampled_from([SUM, MIN, MAX, PRODUCT]), stores=st.sampled_from(STORES))
def test_matches_reference_over_several_calls(size, counts, chunk, code, op, stores):
    # Several calls in a row: chunk numbering and stage reuse carry over.
    calls = [inputs(size, count, code, op, seed=c) for c, count in enumerate(counts)]
    wants = [reference(arrays, code, op) for arrays in calls]
    assert run(calls, code, op, chunk, stores=stores) == streamed_calls_wanted(
        stores, size, 1, counts)
    for arrays, want in zip(calls, wants):
        for a in arrays:
            assert np.array_equal(a, want)


@settings(max_examples=60, deadline=None)
@given(hosts=st.integers(1, 2), local=st.integers(1, 4),
       counts=st.lists(st.lists(st.integers(0, 300), min_size=1, max_size=3), min_size=1,
                       max_size=3),
       chunk=st.sampled_from(CHUNKS), code=st.sampled_from(sorted(HOLDER)),
       op=st.sampled_from([SUM, MIN, MAX, PRODUCT]), stores=st.sampled_from(STORES))
def test_out_of_place_reads_inputs_and_writes_outputs(hosts, local, counts, chunk, code, op,
                                                      stores):
    # Fused calls of several spans, each reading its input where it is and
    # writing its own output; inputs must come back untouched.
    size = hosts * local
    calls, outs, wants = [], [], []
    for c, spans in enumerate(counts):
        per_span = [inputs(size, n, code, op, seed=c * 10 + i) for i, n in enumerate(spans)]
        calls.append([[per_span[i][r] for i in range(len(spans))] for r in range(size)])
        outs.append([[np.full(n, 99, HOLDER[code]) for n in spans] for _ in range(size)])
        wants.append([reference(arrays, code, op) for arrays in per_span])
    kept = [[[a.copy() for a in rank] for rank in call] for call in calls]
    streamed = _hvdmx_testing.shm_allreduce(calls, code, op, chunk, hosts=hosts, outputs=outs,
                                            stores=stores)
    assert streamed == streamed_calls_wanted(stores, size, hosts, [sum(c) for c in counts])
    for c in range(len(calls)):
        for r in range(size):
            for i, want in enumerate(wants[c]):
                assert np.array_equal(outs[c][r][i], want), (c, r, i)
                assert np.array_equal(calls[c][r][i], kept[c][r][i]), "an input was written"


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("code", sorted(HOLDER))
def test_large_counts_not_divisible_by_anything(size, code):
    count = 3 * 65536 + 7
    for op in [SUM, MAX]:
        calls = [inputs(size, count, code, op)]
        want = reference(calls[0], code, op)
        run(calls, code, op, 4096 + 64)
        for a in calls[0]:
            assert np.array_equal(a, want)


@pytest.mark.parametrize("stores", [CACHED, STREAMING], ids=["cached", "streaming"])
@pytest.mark.parametrize("size", [2, 3, 5])
def test_float_sums_in_rank_order_and_bitwise_identical(size, stores):
    # Sums whose value depends on the order of additions: every rank must get
    # the bits of ((x0 + x1) + x2) + ..., whatever the chunking and stores.
    rng = np.random.default_rng(size)
    count = 50_001
    for chunk in [64, 4096, 1 << 20]:
        arrays = [(rng.standard_normal(count) * 10 ** rng.uniform(-3, 3, count)).astype(np.float32)
                  for _ in range(size)]
        want = arrays[0].copy()
        for a in arrays[1:]:
            want = want + a  # float32 adds, in rank order
        run([arrays], FLOAT32, SUM, chunk, stores=stores)
        for a in arrays:
            assert a.tobytes() == want.tobytes()


@settings(max_examples=40, deadline=None)
@given(hosts=st.integers(2, 3), local=st.integers(1, 3),
       counts=st.lists(st.integers(0, 300), min_size=1, max_size=3),
       chunk=st.sampled_from(CHUNKS), code=st.sampled_from(sorted(HOLDER)),
       op=st.sampled_from([SUM, MIN, MAX, PRODUCT]))
def test_hierarchical_matches_reference(hosts, local, counts, chunk, code, op):
    size = hosts * local
    calls = [inputs(size, count, code, op, seed=c) for c, count in enumerate(counts)]
    wants = [reference(arrays, code, op) for arrays in calls]
    run(calls, code, op, chunk, hosts)
    for arrays, want in zip(calls, wants):
        for a in arrays:
            assert np.array_equal(a, want)


@pytest.mark.parametrize("hosts,local", [(2, 2), (3, 2), (2, 3)])
def test_hierarchical_float_sums_are_bitwise_identical(hosts, local):
    rng = np.random.default_rng(hosts * 10 + local)
    count = 30_001
    arrays = [(rng.standard_normal(count) * 10 ** rng.uniform(-3, 3, count)).astype(np.float32)
              for _ in range(hosts * local)]
    exact = np.sum([a.astype(np.float64) for a in arrays], axis=0)
    run([arrays], FLOAT32, SUM, 4096, hosts)
    for a in arrays:
        assert a.tobytes() == arrays[0].tobytes()
    assert np.allclose(arrays[0], exact, rtol=1e-4, atol=1e-2)


@pytest.mark.parametrize("stores", [CACHED, STREAMING], ids=["cached", "streaming"])
def test_unaligned_buffers(stores):
    # Buffers at odd addresses (views one element into a larger array) and at
    # different page offsets on different ranks.
    count = 20_000
    bases = [np.zeros(count + 8, dtype=np.float32) for _ in range(3)]
    arrays = [b[r + 1:r + 1 + count] for r, b in enumerate(bases)]
    for r, a in enumerate(arrays):
        a[:] = mixed(r, count)
    want = reference(arrays, FLOAT32, SUM)
    run([arrays], FLOAT32, SUM, 4096, stores=stores)
    for a in arrays:
        assert np.array_equal(a, want)


def scatter(array, counts, shift):
    """``array`` cut into pieces of ``counts`` (then the rest), each copied into
    an array of its own, at its own offset from a fresh allocation."""
    pieces, at = [], 0
    for i, count in enumerate(list(counts) + [len(array) - sum(counts)]):
        offset = (i + shift) % 16
        piece = np.zeros(count + 16, dtype=array.dtype)[offset:offset + count]
        piece[:] = array[at:at + count]
        pieces.append(piece)
        at += count
    return pieces


def run_fused(calls, counts, code, op, chunk, hosts=1, postscale=1.0, stores=AUTO):
    """Like run(), but each rank's array travels as separate pieces in one
    fused call (ShmAllreduce::Span); returns the results joined again."""
    scattered = [[scatter(a, counts, shift=r) for r, a in enumerate(arrays)] for arrays in calls]
    _hvdmx_testing.shm_allreduce(scattered, code, op, chunk, hosts=hosts, postscale=postscale,
                                 stores=stores)
    return [[np.concatenate(pieces) for pieces in ranks] for ranks in scattered]


def scaled(array, code, factor):
    """ScaleBuffer's result: what the scale inside the allreduce must give."""
    out = array.copy()
    _hvdmx_testing.scale(out, code, factor)
    return out


@settings(max_examples=80, deadline=None)
@given(local=st.integers(1, 4), hosts=st.integers(1, 2),
       counts=st.lists(st.integers(0, 200), min_size=1, max_size=6), rest=st.integers(0, 200),
       chunk=st.sampled_from(CHUNKS), code=st.sampled_from(sorted(HOLDER)),
       op=st.sampled_from([SUM, MIN, MAX, PRODUCT]), stores=st.sampled_from(STORES))
def test_fused_pieces_match_reference(local, hosts, counts, rest, chunk, code, op, stores):
    # Chunks and slices cut across pieces, empty pieces, pieces at unrelated
    # addresses; two calls in a row keep the chunk numbering in step; the
    # result scaled block by block (Average's 1/size) has ScaleBuffer's bits.
    size = local * hosts
    calls = [inputs(size, sum(counts) + rest, code, op, seed=c) for c in range(2)]
    factor = 1.0 / size if op == SUM else 1.0
    wants = [scaled(reference(arrays, code, op), code, factor) for arrays in calls]
    for results, want in zip(run_fused(calls, counts, code, op, chunk, hosts, factor, stores),
                             wants):
        for got in results:
            assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("stores", [CACHED, STREAMING], ids=["cached", "streaming"])
@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("chunk", [64, 4096, 1 << 20])
def test_fused_pieces_give_the_bits_of_one_buffer(size, chunk, stores):
    # Sums whose value depends on who adds what: the fused call must give
    # the bits of one call on the whole buffer.
    rng = np.random.default_rng(size * chunk)
    count = 40_003
    arrays = [(rng.standard_normal(count) * 10 ** rng.uniform(-3, 3, count)).astype(np.float32)
              for _ in range(size)]
    counts = [1, 0, 999, 5000, 17, 0, 12_345]
    fused = run_fused([arrays], counts, FLOAT32, SUM, chunk, postscale=1 / 3, stores=stores)[0]
    run([arrays], FLOAT32, SUM, chunk)  # auto: cached below 1 MiB
    want = scaled(arrays[0], FLOAT32, 1 / 3)
    for got in fused:
        assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("size", [2, 3])
def test_auto_stores_try_both_kinds_from_64_kib(size):
    # Ten calls of 64 KiB: a warm-up and three calls cached, three streamed,
    # then whichever was faster here (StageStoreChooser); every result exact.
    count = (64 << 10) // 4
    calls = [inputs(size, count, FLOAT32, SUM, seed=c) for c in range(10)]
    wants = [reference(arrays, FLOAT32, SUM) for arrays in calls]
    streamed = run(calls, FLOAT32, SUM, 256 * 1024, stores=AUTO)
    assert all(3 <= s <= 6 for s in streamed), streamed
    for arrays, want in zip(calls, wants):
        for a in arrays:
            assert np.array_equal(a, want)


MIB = 1 << 20
# StageStoreChooser::kExploreEvery, kTrials, kSamples
EXPLORE_EVERY, TRIALS, SAMPLES = 64, 3, 5


def choices(stores, calls):
    """StageStoreChooser's picks for calls of (bytes, seconds cached, seconds
    streaming), as a string: c cached, s streamed."""
    return "".join("s" if s else "c" for s in _hvdmx_testing.stage_store_chooser(stores, calls))


def test_chooser_keeps_the_faster_kind_and_looks_at_the_other_now_and_then():
    # Streaming twice as fast: after the warm-up, three cached and three
    # streamed calls, it streams, except for the last three calls of every 64.
    picks = choices(AUTO, [(4 * MIB, 2e-3, 1e-3)] * 200)
    assert picks[:7] == "ccccsss"
    for i in range(7, 200):
        exploring = i % EXPLORE_EVERY >= EXPLORE_EVERY - TRIALS
        assert picks[i] == ("c" if exploring else "s"), i
    # Cached faster: the mirror image.
    picks = choices(AUTO, [(4 * MIB, 1e-3, 2e-3)] * 200)
    assert picks[:7] == "ccccsss"
    for i in range(7, 200):
        exploring = i % EXPLORE_EVERY >= EXPLORE_EVERY - TRIALS
        assert picks[i] == ("s" if exploring else "c"), i


def test_chooser_follows_a_change_of_phase():
    # Streaming wins for 100 calls, then cached does. Once five streamed
    # calls in a row were slow, streaming is no faster than the cached calls
    # it remembers (a tie stays cached); the explorations (calls 125-127,
    # 189-191) confirm it.
    calls = [(4 * MIB, 2e-3, 1e-3)] * 100 + [(4 * MIB, 1e-3, 2e-3)] * 200
    picks = choices(AUTO, calls)
    assert set(picks[7:61]) == {"s"} and picks[61:64] == "ccc"
    assert picks[100:100 + SAMPLES] == "s" * SAMPLES
    assert set(picks[100 + SAMPLES:125]) == {"c"}
    assert picks[125:128] == "sss"
    assert set(picks[128:189]) == {"c"}
    # Cached wins first, then streaming. Slow cached calls only bring cached
    # level with the streaming calls it remembers, so the next exploration
    # (calls 61-63) finds streaming faster.
    calls = [(4 * MIB, 1e-3, 2e-3)] * 30 + [(4 * MIB, 2e-3, 1e-3)] * 100
    picks = choices(AUTO, calls)
    assert set(picks[7:61]) == {"c"}
    assert set(picks[61:125]) == {"s"}


def test_chooser_is_not_moved_by_a_burst_of_slow_calls():
    # Four streamed calls in a row 100x slower (a late peer, a preemption)
    # among fast ones: the fastest of the last five is still fast.
    calls = ([(4 * MIB, 2e-3, 1e-3)] * 20 + [(4 * MIB, 2e-3, 1e-1)] * (SAMPLES - 1)
             + [(4 * MIB, 2e-3, 1e-3)] * 30)
    picks = choices(AUTO, calls)
    assert set(picks[7:]) == {"s"}


def test_chooser_sizes_are_chosen_for_apart():
    # Below 64 KiB: always cached, whatever the times. 1 MiB and 3 MiB are in
    # different classes (factors of 2), each with its own warm-up and trials.
    picks = choices(AUTO, [((64 << 10) - 1, 1.0, 1e-9)] * 20)
    assert picks == "c" * 20
    calls = [(MIB, 2e-3, 1e-3), (3 * MIB, 1e-3, 2e-3)] * 30
    picks = choices(AUTO, calls)
    assert picks[0::2][:7] == "ccccsss" and set(picks[0::2][7:]) == {"s"}
    assert picks[1::2][:7] == "ccccsss" and set(picks[1::2][7:]) == {"c"}


@pytest.mark.parametrize("stores,want", [(CACHED, "c"), (STREAMING, "s")])
def test_chooser_forced_kinds_never_change(stores, want):
    calls = [(b, 1e-3 if want == "s" else 2e-3, 2e-3 if want == "s" else 1e-3)
             for b in [1, (64 << 10) - 1, MIB, 100 * MIB, 1 << 40]] * 30
    assert choices(stores, calls) == want * len(calls)


def test_chooser_refuses_an_unknown_kind():
    with pytest.raises(ValueError, match="stores must be"):
        _hvdmx_testing.stage_store_chooser(3, [])


@pytest.mark.parametrize("length", [0, 1, 15, 16, 17, 63, 64, 65, 127, 200, 4096 + 33])
def test_streaming_copy_copies_every_byte_at_every_alignment(length):
    # Heads and tails around the 16-byte aligned streaming part, at every
    # offset of source and destination; the bytes around dst stay untouched.
    src_base = ((np.arange(length + 64) * 37 + 11) % 251).astype(np.uint8)
    for dst_offset in range(17):
        for src_offset in (0, 1, 8, 31):
            dst_base = np.full(length + 64, 0xEE, np.uint8)
            dst = dst_base[dst_offset:dst_offset + length]
            src = src_base[src_offset:src_offset + length]
            _hvdmx_testing.streaming_copy(dst, src)
            assert np.array_equal(dst, src), (dst_offset, src_offset)
            assert (dst_base[:dst_offset] == 0xEE).all()
            assert (dst_base[dst_offset + length:] == 0xEE).all()


@settings(max_examples=200, deadline=None)
@given(length=st.integers(0, 10_000), n=st.integers(1, 9), unit=st.sampled_from([1, 8, 16, 64]))
def test_slices_cover_the_chunk_in_order(length, n, unit):
    starts = [_hvdmx_testing.shm_slice_start(length, n, j, unit) for j in range(n + 1)]
    assert starts[0] == 0 and starts[-1] == length
    assert starts == sorted(starts)
    units = -(-length // unit)
    for j in range(n):
        # slices start at whole units, or at the end (empty slices)
        assert starts[j] % unit == 0 or starts[j] == length
        # balanced: no slice longer than its share, rounded up to whole units
        assert starts[j + 1] - starts[j] <= -(-units // n) * unit


# ---- broadcast, allgather and alltoall through the stages --------------------
# Calls for _hvdmx_testing.shm_sequence: (kind, inputs, outputs, ints), one
# array per rank; built with what each rank should end up holding.

def bytes_of(rank, call, n):
    """Distinct bytes for (rank, call): a mistake shows which rank's went where."""
    return ((np.arange(n) * 7 + rank * 31 + call * 13) % 251).astype(np.uint8)


def broadcast_call(size, call, n, root):
    arrays = [bytes_of(r, call, n) for r in range(size)]
    return ("broadcast", arrays, [], [root]), [arrays[root].copy()] * size, arrays


def broadcast_out_call(size, call, n, root):
    """Out of place: the root's input lands in every output; inputs stay."""
    ins = [bytes_of(r, call, n) for r in range(size)]
    outs = [np.zeros(n, np.uint8) for _ in range(size)]
    kept = [a.copy() for a in ins]
    return (("broadcast", ins, outs, [root]), [ins[root].copy()] * size + kept, outs + ins)


def allgather_call(size, call, blocks):
    ins = [bytes_of(r, call, blocks[r]) for r in range(size)]
    starts = np.concatenate([[0], np.cumsum(blocks)]).astype(int).tolist()
    outs = [np.zeros(starts[-1], np.uint8) for _ in range(size)]
    want = np.concatenate(ins)
    return ("allgather", ins, outs, starts), [want] * size, outs


def alltoall_call(size, call, matrix):
    """matrix[i][j]: bytes rank i sends to rank j."""
    ins = [bytes_of(i, call, sum(matrix[i])) for i in range(size)]
    def piece(i, j):
        start = sum(matrix[i][:j])
        return ins[i][start:start + matrix[i][j]]
    wants = [np.concatenate([piece(i, j) for i in range(size)]) for j in range(size)]
    outs = [np.zeros(len(w), np.uint8) for w in wants]
    flat = [matrix[i][j] for i in range(size) for j in range(size)]
    return ("alltoall", ins, outs, flat), wants, outs


def allreduce_call(size, call, count):
    arrays = inputs(size, count, FLOAT32, SUM, seed=call)
    want = reference(arrays, FLOAT32, SUM)
    return ("allreduce", arrays, [], [FLOAT32, SUM]), [want] * size, arrays


def reducescatter_call(size, call, blocks, code=FLOAT32, op=SUM):
    """blocks[j]: elements rank j keeps; every rank's input is all of them."""
    starts = np.concatenate([[0], np.cumsum(blocks)]).astype(int).tolist()
    arrays = inputs(size, starts[-1], code, op, seed=call)
    total = reference(arrays, code, op)
    wants = [total[starts[j]:starts[j + 1]] for j in range(size)]
    outs = [np.zeros(blocks[j], HOLDER[code]) for j in range(size)]
    kept = [a.copy() for a in arrays]
    return (("reducescatter", arrays, outs, [code, op] + starts), wants + kept, outs + arrays)


def bitand_call(size, call, n):
    """Words with about one bit in four cleared, different on every rank."""
    rng = np.random.default_rng(call * 100 + size)
    words = [~(rng.integers(0, 2 ** 63, n, dtype=np.uint64)
               & rng.integers(0, 2 ** 63, n, dtype=np.uint64)) for _ in range(size)]
    want = np.bitwise_and.reduce(np.stack(words), axis=0) if n else words[0].copy()
    return ("bitand", words, [], []), [want] * size, words


@st.composite
def mixed_sequences(draw):
    size = draw(st.integers(1, 5))
    lengths = st.integers(0, 700)
    calls = []
    for c in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["allreduce", "broadcast", "broadcast_out", "allgather",
                                     "alltoall", "bitand", "reducescatter"]))
        if kind == "allreduce":
            calls.append(allreduce_call(size, c, draw(lengths)))
        elif kind == "bitand":
            calls.append(bitand_call(size, c, draw(st.integers(0, MAX_BIT_AND_WORDS))))
        elif kind == "reducescatter":
            calls.append(reducescatter_call(
                size, c, draw(st.lists(lengths, min_size=size, max_size=size)),
                draw(st.sampled_from(sorted(HOLDER))),
                draw(st.sampled_from([SUM, MIN, MAX, PRODUCT]))))
        elif kind == "broadcast":
            calls.append(broadcast_call(size, c, draw(lengths), draw(st.integers(0, size - 1))))
        elif kind == "broadcast_out":
            calls.append(broadcast_out_call(size, c, draw(lengths),
                                            draw(st.integers(0, size - 1))))
        elif kind == "allgather":
            calls.append(allgather_call(size, c, draw(st.lists(lengths, min_size=size,
                                                                max_size=size))))
        else:
            matrix = [draw(st.lists(st.integers(0, 300), min_size=size, max_size=size))
                      for _ in range(size)]
            calls.append(alltoall_call(size, c, matrix))
    return calls


MOVES = ("broadcast", "allgather", "alltoall")


def smallest_output(kind, ints, size):
    """The fewest bytes any rank's allgather or alltoall output has."""
    if kind == "allgather":
        return ints[-1]
    return min(sum(ints[i * size + j] for i in range(size)) for j in range(size))


@settings(max_examples=150, deadline=None)
@given(calls=mixed_sequences(), chunk=st.sampled_from([64, 128, 192, 4096]),
       direct=st.sampled_from([-1, 0, 200]), stores=st.sampled_from([CACHED, STREAMING]),
       push=st.sampled_from(["off", "every rank", "all but the last"]))
def test_mixed_calls_move_every_byte(calls, chunk, direct, stores, push):
    # Interleaved with allreduces, in any order and with empty streams on
    # some ranks: the chunk numbering must stay in step on every rank, with
    # some moves read from the peers' buffers directly (direct >= 0: those
    # whose longest stream has at least `direct` bytes) and some staged, and
    # the allreduces' stages written with either kind of store. With push,
    # allgathers and alltoalls write into the peers' outputs where every
    # rank's output is in the shared file and has a byte or more; where one
    # rank's is not, every rank falls back to the stages or direct reads.
    specs = [spec for spec, _, _ in calls]
    size = len(specs[0][1])
    flags = {"off": [], "every rank": [True] * size,
             "all but the last": [True] * (size - 1) + [False]}[push]
    direct_calls, pushed_calls, root_writes = _hvdmx_testing.shm_sequence(
        specs, chunk, direct, stores, flags)
    pushed = [push == "every rank" and size > 1 and kind in ("allgather", "alltoall")
              and smallest_output(kind, ints, size) > 0 for kind, _, _, ints in specs]
    assert pushed_calls == sum(pushed)
    if direct < 0 or size == 1:
        assert direct_calls == 0
    else:
        def longest(kind, ins, ints):
            if kind == "broadcast":
                return ins[ints[0]].nbytes
            if kind == "allgather":
                return max(ints[j + 1] - ints[j] for j in range(size))
            return max(sum(ints[i * size:(i + 1) * size]) - ints[i * size + i]
                       for i in range(size))
        taken = [kind in MOVES and not p and 0 < longest(kind, ins, ints) >= direct
                 for (kind, ins, _, ints), p in zip(specs, pushed)]
        assert direct_calls == sum(taken)
        # A direct broadcast's root writes the last 1/size of each peer's
        # read, in whole 64-byte lines, when that is a line or more, if it
        # broadcasts in place (out of place it copies its own output).
        assert root_writes == sum(
            1 for (kind, ins, outs, ints), t in zip(specs, taken)
            if t and kind == "broadcast" and not outs and ins[ints[0]].nbytes // size // 64 > 0)
    if direct < 0 or size == 1:
        assert root_writes == 0
    for spec, wants, results in calls:
        for rank, (got, want) in enumerate(zip(results, wants)):
            assert np.array_equal(got, want), f"{spec[0]} on rank {rank}"


@pytest.mark.parametrize("size", [2, 3, 5])
def test_bit_ands_in_a_row(size):
    # Each rank keeps two sets of words and reuses them every other call.
    calls = [bitand_call(size, c, [1, MAX_BIT_AND_WORDS, 18][c % 3]) for c in range(200)]
    _hvdmx_testing.shm_sequence([spec for spec, _, _ in calls], 4096)
    for c, (spec, wants, results) in enumerate(calls):
        for rank, (got, want) in enumerate(zip(results, wants)):
            assert np.array_equal(got, want), f"bit-and {c} on rank {rank}"


@pytest.mark.parametrize("direct, push", [(-1, False), (0, False), (-1, True), (0, True)],
                         ids=["staged", "direct", "pushed", "direct and pushed"])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_large_byte_moves_over_many_chunks(size, direct, push):
    # Direct and pushed: the out-of-place broadcast's outputs lie in the
    # shared file (its root writes into none: it copies its own output).
    n = 3 * 65536 + 5
    calls = [broadcast_call(size, 0, n, size - 1),
             broadcast_out_call(size, 4, n + 17, 0),
             allgather_call(size, 1, [n + r * 4099 for r in range(size)]),
             alltoall_call(size, 2, [[(i + 1) * 5001 + j * 77 for j in range(size)]
                                     for i in range(size)]),
             allreduce_call(size, 3, n),
             reducescatter_call(size, 5, [n // 3 + j * 1001 for j in range(size)]),
             reducescatter_call(size, 6, [0] + [n // 5] * (size - 1), FLOAT64, MAX)]
    direct_calls, pushed_calls, root_writes = _hvdmx_testing.shm_sequence(
        [spec for spec, _, _ in calls], 4096 + 64, direct,
        STREAMING if direct == 0 else CACHED, [push] * size)
    # Broadcasts never push: an in-place one writes the caller's own array.
    # Read directly, the in-place one's root writes part of every peer's output.
    assert (direct_calls, pushed_calls) == ((2 if push else 4) if direct == 0 else 0,
                                            (2 if push else 0))
    assert root_writes == (1 if direct == 0 else 0)
    for spec, wants, results in calls:
        for got, want in zip(results, wants):
            assert np.array_equal(got, want), spec[0]


@pytest.mark.parametrize("direct, push", [(-1, False), (0, False), (-1, True)],
                         ids=["staged", "direct", "pushed"])
def test_allgather_in_place_block_is_left_alone(direct, push):
    # The fused allgather passes its own block already at its place in the
    # output: it must not be copied onto itself (or lost).
    size, blocks = 3, [100, 0, 257]
    starts = np.concatenate([[0], np.cumsum(blocks)]).astype(int).tolist()
    want = np.concatenate([bytes_of(r, 0, blocks[r]) for r in range(size)])
    outs = []
    for r in range(size):
        out = np.zeros(starts[-1], np.uint8)
        out[starts[r]:starts[r + 1]] = want[starts[r]:starts[r + 1]]
        outs.append(out)
    ins = [out[starts[r]:starts[r + 1]] for r, out in enumerate(outs)]
    counts = _hvdmx_testing.shm_sequence([("allgather", ins, outs, starts)], 64, direct, 0,
                                         [push] * size)
    assert counts == ((0, 1, 0) if push else (int(direct == 0), 0, 0))
    for out in outs:
        assert np.array_equal(out, want)


MAX_PAYLOAD = _hvdmx_testing.SHM_MAX_PAYLOAD_BYTES


@pytest.mark.parametrize("size", [2, 3, 5])
def test_control_comm_carries_payloads_and_strings(size):
    # Bit-ands with payloads of every length up to a mailbox's, and string
    # broadcasts from every root, some longer than a mailbox (those go
    # through the inner comm), many in a row so that each mailbox is
    # reused while peers may still be reading the other one.
    rng = np.random.default_rng(size)

    def blob(n):
        return rng.integers(0, 256, n, dtype=np.uint8).tobytes()

    steps = []
    for i in range(300):
        if i % 3 == 0:
            lengths = rng.choice([0, 1, 100, MAX_PAYLOAD], size)
            steps.append((-1, [blob(n) for n in lengths]))
        else:
            n = [0, 7, 5000, MAX_PAYLOAD, MAX_PAYLOAD + 1, 3 * MAX_PAYLOAD][i // 3 % 6]
            steps.append((int(rng.integers(0, size)), [blob(n)]))
    got, through_shm = _hvdmx_testing.shm_control_comm(size, steps)
    for rank in range(size):
        for i, (root, data) in enumerate(steps):
            if root < 0:
                assert got[rank][i] == (data if rank == 0 else []), f"step {i} on rank {rank}"
            else:
                assert got[rank][i] == data, f"step {i} on rank {rank}"
    assert through_shm == sum(1 for root, data in steps
                              if root >= 0 and len(data[0]) <= MAX_PAYLOAD)


def test_control_comm_refuses_a_payload_longer_than_its_mailbox():
    with pytest.raises(ValueError, match="kMaxPayloadBytes"):
        _hvdmx_testing.shm_control_comm(2, [(-1, [b"", b"x" * (MAX_PAYLOAD + 1)])])


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("kind", ["allreduce", "broadcast", "bitand", "string"])
def test_a_peer_that_stops_ends_the_waits_for_it(size, kind):
    # Note [A peer that stops]: the last rank marks itself stopped instead of
    # making the call; every other rank's call throws instead of waiting.
    stopper = size - 1
    said = _hvdmx_testing.shm_peer_stops(size, stopper, kind)
    assert said[stopper] == ""
    for r in range(size - 1):
        assert said[r].startswith(f"hvdmx: rank {stopper} of this host (pid "), said
        assert "has stopped hvdmx" in said[r] and "hvdmx has stopped on this rank too" in said[r]


def half_values(size, count, code, seed=0):
    """float32 integers exact in the half dtype (spacing 1 there) whose sums
    are not: [1024, 2048) for float16, [128, 256) for bfloat16."""
    top = 1024 if code == FLOAT16 else 128
    i = np.arange(count)
    return [(top + (i * 37 + r * 101 + seed) % top).astype(np.float32) for r in range(size)]


def round_half(x, code):
    """float32 to the half dtype's holder, to nearest-even."""
    if code == FLOAT16:
        return x.astype(np.float16)
    bits = x.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def prescaled(x, factor, code):
    """float32 x times the prescale as the core takes it (issue 46): scaled in
    float32, rounded to the dtype, widened back."""
    if factor == 1.0:
        return x
    half = round_half(x * np.float32(factor), code)
    if code == FLOAT16:
        return half.astype(np.float32)
    return (half.astype(np.uint32) << 16).view(np.float32)


@settings(max_examples=40, deadline=None)
@given(layout=st.sampled_from([(3, 1), (4, 1), (5, 1), (4, 2), (6, 2), (6, 3)]),
       counts=st.lists(st.integers(0, 300), min_size=1, max_size=3),
       chunk=st.sampled_from(CHUNKS), code=st.sampled_from([FLOAT16, BFLOAT16]),
       scales=st.sampled_from([(1.0, 1.0), (0.5, 3.0), (2.0, 0.25), (1 / 3, 1.0), (0.7, 3.0),
                               (1.3, 0.1)]),
       stores=st.sampled_from(STORES))
def test_half_summed_in_float32_rounded_once(layout, counts, chunk, code, scales, stores):
    # Note [Half precision summed in float32]: on one host and across
    # pretend hosts (the hosts' ring takes float32 host sums), the result is
    # the float32 sum of the operands, each prescaled and rounded to the
    # dtype first (issue 46), postscaled, rounded once.
    size, hosts = layout
    pre, post = scales
    values = [half_values(size, count, code, seed=c) for c, count in enumerate(counts)]
    calls = [[round_half(v, code) for v in vs] for vs in values]
    wants = [round_half(np.sum([prescaled(v, pre, code) for v in vs], axis=0, dtype=np.float32)
                        * np.float32(post), code) for vs in values]
    _hvdmx_testing.shm_allreduce([[[a] for a in arrays] for arrays in calls], code, SUM, chunk,
                                 hosts=hosts, prescale=pre, postscale=post, stores=stores)
    for arrays, want in zip(calls, wants):
        for a in arrays:
            assert a.tobytes() == want.tobytes()
