"""op=hvd.Adasum: the collectives against a float64 numpy reference of the
same recursion (csrc/hvdmx/algorithms/adasum.h), the hand-made cases that
are exact (orthogonal gradients add, identical ones average), tensor
boundaries inside a fused group, and what the call refuses."""
import socket

import mxnet as mx
import numpy as np
import pytest

import hvdmx as hvd
from conftest import all_equal_across_ranks
from helpers import counts_for, mixed, restarted

FLOATS = ["float16", "float32", "float64"]
# The reference is float64 throughout; the core rounds each level's result
# to the dtype, so a few units in the last place of the dtype per level.
TOLERANCE = {"float16": 1e-2, "float32": 1e-5, "float64": 1e-12}
NORM_FLOOR = 1e-8  # kAdasumNormFloor


def pair(a, b):
    """a (+) b, Horovod's pairwise adaptive sum, in float64."""
    dot, aa, bb = np.dot(a, b), np.dot(a, a), np.dot(b, b)
    ca = 1.0 - dot / aa * 0.5 if aa >= NORM_FLOOR else 1.0
    cb = 1.0 - dot / bb * 0.5 if bb >= NORM_FLOOR else 1.0
    return ca * a + cb * b


def reference(vectors):
    """Adasum of one tensor's vectors (one per rank) by the core's recursion:
    ranks p..n-1 fold into rank - p (p the largest power of two <= n), then
    neighbours combine, level by level."""
    n = len(vectors)
    p = 1 << (n.bit_length() - 1)
    level = [pair(vectors[i], vectors[i + p]) if i + p < n else vectors[i] for i in range(p)]
    while len(level) > 1:
        level = [pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def gradient(rank, count, dtype, salt=0):
    """A gradient-like input of `count` elements for `rank`: a direction
    shared by every rank plus one of its own, so that the dots are neither 0
    nor the norms (small integers over 8: exact in every float dtype)."""
    with np.errstate(over="ignore"):  # mixed's 64-bit mix wraps on purpose
        shared = mixed(0, count, salt=salt + 1000).astype(np.float64) - 5
        own = mixed(rank, count, salt=salt).astype(np.float64) - 5
    return ((shared + own) / 8).astype(dtype)


def check_close(got, want, dtype, travelled_as=None):
    """`got` (of `dtype`) is `want` to the tolerance of the dtype it was
    reduced in (`travelled_as`, by default `dtype`) and the same on every rank."""
    assert got.dtype == np.dtype(dtype)
    tolerance = TOLERANCE[travelled_as or dtype]
    scale = max(1.0, float(np.max(np.abs(want)))) if want.size else 1.0
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tolerance,
                               atol=tolerance * scale)
    assert all_equal_across_ranks(got)


@pytest.mark.parametrize("dtype", FLOATS)
def test_allreduce_matches_the_reference(world, dtype):
    rank, size = world
    for count in counts_for(size) + [7, 64]:
        x = mx.nd.array(gradient(rank, count, dtype), dtype=dtype)
        out = hvd.allreduce(x, op=hvd.Adasum, name=f"adasum.{dtype}.{count}")
        want = reference([gradient(r, count, dtype).astype(np.float64) for r in range(size)])
        check_close(out.asnumpy(), want, dtype)
        assert np.array_equal(x.asnumpy(), gradient(rank, count, dtype))  # input untouched


@pytest.mark.parametrize("dtype", FLOATS)
def test_grouped_in_place_and_fused_tensors_match_per_tensor_references(world, dtype):
    rank, size = world
    counts = [size + 1, 1, 0, 300, size - 1 if size > 1 else 2, 1001]
    want = [reference([gradient(r, c, dtype, salt=t).astype(np.float64) for r in range(size)])
            for t, c in enumerate(counts)]

    def inputs():
        return [mx.nd.array(gradient(rank, c, dtype, salt=t), dtype=dtype)
                for t, c in enumerate(counts)]

    for got in (hvd.grouped_allreduce(inputs(), op=hvd.Adasum),
                hvd.grouped_allreduce_(inputs(), op=hvd.Adasum)):
        for g, w in zip(got, want):
            check_close(g.asnumpy(), w, dtype)
    # Separate calls of one round fuse in the core (same dtype and op).
    tensors = inputs()
    for t, x in enumerate(tensors):
        hvd.allreduce_(x, op=hvd.Adasum, name=f"adasum.fused.{dtype}.{t}")
    for g, w in zip(tensors, want):
        check_close(g.asnumpy(), w, dtype)


@pytest.mark.parametrize("dtype", FLOATS)
def test_orthogonal_gradients_add_exactly(world, dtype):
    rank, size = world
    count = 4 * size + 3
    values = mixed(7, count, modulus=9) + 1  # 1..9, nonzero
    # Rank r owns the elements i with i % size == r: the vectors are orthogonal.
    mine = np.where(np.arange(count) % size == rank, values, 0).astype(dtype)
    out = hvd.allreduce(mx.nd.array(mine, dtype=dtype), op=hvd.Adasum)
    got = out.asnumpy()
    assert np.array_equal(got, values.astype(dtype)), got
    assert all_equal_across_ranks(got)


@pytest.mark.parametrize("dtype", FLOATS)
def test_identical_gradients_average_exactly(world, dtype):
    _, size = world
    same = (mixed(3, 5 * size + 2, modulus=13) - 6).astype(dtype)
    same[0] = 1  # not all zero
    got = hvd.allreduce(mx.nd.array(same, dtype=dtype), op=hvd.Adasum).asnumpy()
    assert np.array_equal(got, same), got
    assert all_equal_across_ranks(got)


def test_a_fused_group_never_mixes_its_tensors(world):
    """Tensor 0 identical on every rank (averages), tensor 1 orthogonal
    (adds): combined as one vector, neither would come out exact."""
    rank, size = world
    same = np.array([3, -1, 2, 5], dtype=np.float32)
    values = (mixed(9, 2 * size, modulus=5) + 1).astype(np.float32)
    mine = np.where(np.arange(2 * size) % size == rank, values, 0).astype(np.float32)
    got = hvd.grouped_allreduce([mx.nd.array(same), mx.nd.array(mine)], op=hvd.Adasum)
    assert np.array_equal(got[0].asnumpy(), same)
    assert np.array_equal(got[1].asnumpy(), values)


def test_zero_and_tiny_gradients_keep_coefficient_one(world):
    """A vector whose squared norm is below the floor is added as it is (as
    Horovod does): rank 0 sends x, the others zeros, and x comes out."""
    rank, _ = world
    x = np.array([1e-5, -2e-5, 0, 4e-5], dtype=np.float64)
    mine = x if rank == 0 else np.zeros_like(x)
    got = hvd.allreduce(mx.nd.array(mine, dtype="float64"), op=hvd.Adasum).asnumpy()
    assert np.array_equal(got, x)


def test_scale_factors(world):
    """Each rank's input times the prescale (in the dtype), the result times
    the postscale."""
    rank, size = world
    count = 2 * size + 5
    x = mx.nd.array(gradient(rank, count, "float64"), dtype="float64")
    out = hvd.allreduce(x, op=hvd.Adasum, prescale_factor=0.25, postscale_factor=3.0)
    want = reference([gradient(r, count, "float64") * 0.25 for r in range(size)]) * 3.0
    check_close(out.asnumpy(), want, "float64")


def test_every_rank_count_with_a_tiny_fusion_threshold(world):
    """Groups cut small by the fusion threshold, and tensors larger than it
    reduced alone, still match."""
    rank, size = world
    with restarted({"HVDMX_FUSION_THRESHOLD": "256"}):
        counts = [3, 100, 5, 1, 64]
        tensors = [mx.nd.array(gradient(rank, c, "float32", salt=t)) for t, c in enumerate(counts)]
        for t, x in enumerate(tensors):
            hvd.allreduce_(x, op=hvd.Adasum, name=f"adasum.tiny.{t}")
        for t, (x, c) in enumerate(zip(tensors, counts)):
            want = reference([gradient(r, c, "float32", salt=t).astype(np.float64)
                              for r in range(size)])
            check_close(x.asnumpy(), want, "float32")


@pytest.mark.parametrize("dtype", FLOATS)
def test_hierarchical_averages_in_each_host_then_adasum_between_hosts(world, dtype):
    """HVDMX_ADASUM_HIERARCHICAL=1 on pretend hosts of two ranks."""
    rank, size = world
    with restarted({"HVDMX_ADASUM_HIERARCHICAL": "1", "HVDMX_TESTING_RANKS_PER_HOST": "2"}):
        counts = [size + 1, 1, 300]
        got = hvd.grouped_allreduce([mx.nd.array(gradient(rank, c, dtype, salt=t), dtype=dtype)
                                     for t, c in enumerate(counts)], op=hvd.Adasum)
        for t, (g, c) in enumerate(zip(got, counts)):
            vectors = [gradient(r, c, dtype, salt=t).astype(np.float64) for r in range(size)]
            hosts = [vectors[h:h + 2] for h in range(0, size, 2)]
            want = reference([np.mean(host, axis=0) for host in hosts])
            check_close(g.asnumpy(), want, dtype)


def test_hierarchical_on_the_real_hosts(world):
    """HVDMX_ADASUM_HIERARCHICAL=1 with the hosts the job runs on (one here;
    tests/test_many_hosts.py runs it across test hosts): each host's
    average, combined by Adasum in the order of the hosts' lowest ranks."""
    rank, size = world
    names = hvd.allgather_object(socket.gethostname(), name="adasum.hostnames")
    with restarted({"HVDMX_ADASUM_HIERARCHICAL": "1"}):
        count = 2 * size + 3
        got = hvd.allreduce(mx.nd.array(gradient(rank, count, "float32")), op=hvd.Adasum)
        hosts = {}
        for r, host in enumerate(names):  # in rank order: hosts by their lowest rank
            hosts.setdefault(host, []).append(gradient(r, count, "float32").astype(np.float64))
        want = reference([np.mean(vectors, axis=0) for vectors in hosts.values()])
        check_close(got.asnumpy(), want, "float32")


@pytest.mark.parametrize("dtype", ["int32", "uint8", "int64", "int8"])
def test_integer_tensors_are_refused_at_the_call(dtype):
    x = mx.nd.ones((3,), dtype=dtype)
    for call in (lambda: hvd.allreduce(x, op=hvd.Adasum),
                 lambda: hvd.allreduce_(x, op=hvd.Adasum),
                 lambda: hvd.allreduce_(x, op=hvd.Adasum, name="adasum.int"),
                 lambda: hvd.grouped_allreduce([mx.nd.ones((2,)), x], op=hvd.Adasum)):
        with pytest.raises(TypeError, match=f"op=hvd.Adasum needs floating tensors, and "
                                            f"argument '.*' has dtype {dtype}; use float16"):
            call()


def test_process_sets_are_refused_at_the_call(world):
    _, size = world
    everyone = hvd.add_process_set(list(range(size)))
    try:
        with pytest.raises(ValueError, match=f"process_set={everyone.process_set_id} is not "
                                             "the global set .* use process_set=hvd.global_"):
            hvd.allreduce(mx.nd.ones((2,)), op=hvd.Adasum, process_set=everyone)
        with pytest.raises(ValueError, match="is not the global set"):
            hvd.grouped_allreduce_([mx.nd.ones((2,))], op=hvd.Adasum, process_set=everyone)
    finally:
        hvd.remove_process_set(everyone)


# ---- training: DistributedTrainer, DistributedOptimizer, KVStore --------------

def everyones(array):
    """Every rank's `array` (numpy), in rank order."""
    return hvd.allgather_object(array, name=f"adasum.everyones.{everyones.calls}")


everyones.calls = 0


@pytest.mark.parametrize("num_groups", [0, 2])
def test_trainer_applies_the_adasum_of_the_gradients_at_one_rank_scale(world, num_groups):
    rank, size = world
    net = mx.gluon.nn.Dense(3, in_units=5)
    net.initialize(mx.init.Constant(0.5))
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.5},
                                     op=hvd.Adasum, prefix=f"adasum.trainer{num_groups}.",
                                     num_groups=num_groups)
    params = sorted(net.collect_params().items())
    x = mx.nd.array(gradient(rank, 10, "float32").reshape(2, 5))
    with mx.autograd.record():
        loss = (net(x) * mx.nd.array([[1, -2, 3]])).sum()
    loss.backward()
    before = [p.data().asnumpy().astype(np.float64) for _, p in params]
    local = [p.grad().asnumpy().astype(np.float64) for _, p in params]
    everyones.calls += 1
    all_grads = everyones(local)
    trainer.step(2)
    for k, (name, p) in enumerate(params):
        combined = reference([g[k].ravel() for g in all_grads]).reshape(before[k].shape)
        check_close(p.data().asnumpy(), before[k] - 0.5 * combined / 2, "float32")


def test_optimizer_update_reduces_with_adasum(world):
    rank, size = world
    opt = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=1.0), op=hvd.Adasum)
    assert "op=hvd.Adasum" in repr(opt)
    weight = mx.nd.zeros((6,), dtype="float64")
    grad = mx.nd.array(gradient(rank, 6, "float64"), dtype="float64")
    opt.update(0, weight, grad, opt.create_state(0, weight))
    want = -reference([gradient(r, 6, "float64") for r in range(size)])
    check_close(weight.asnumpy(), want, "float64")


@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_kvstore_pushpull_is_adasum_times_size(world, compression):
    rank, size = world
    kv = hvd.KVStore(op=hvd.Adasum, prefix=f"adasum.{compression}.",
                     compression=getattr(hvd.Compression, compression))
    value = mx.nd.array(gradient(rank, 9, "float32"))
    kv.pushpull(3, value)
    want = reference([gradient(r, 9, "float32").astype(np.float64) for r in range(size)]) * size
    check_close(value.asnumpy(), want, "float32",
                travelled_as="float32" if compression == "none" else "float16")


def test_training_arguments_that_adasum_refuses():
    params = mx.gluon.nn.Dense(2, in_units=2).collect_params()
    params.initialize()
    with pytest.raises(ValueError, match="'gradient_predivide_factor'=2.0 does not apply to "
                                         "op=hvd.Adasum"):
        hvd.DistributedTrainer(params, "sgd", op=hvd.Adasum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="compression=hvd.Compression.onebit sums quantized "
                                         "gradients and cannot take op=hvd.Adasum"):
        hvd.DistributedTrainer(params, "sgd", op=hvd.Adasum, compression=hvd.Compression.onebit)
    with pytest.raises(ValueError, match="local_sgd_steps=4 sends no gradients"):
        hvd.DistributedTrainer(params, "sgd", op=hvd.Adasum, local_sgd_steps=4)
    with pytest.raises(ValueError, match=r"argument 'op'=1 is not supported; use hvd.Average"):
        hvd.DistributedTrainer(params, "sgd", op=hvd.Sum)
    with pytest.raises(ValueError, match="'gradient_predivide_factor'=0.5 does not apply"):
        hvd.DistributedOptimizer(mx.optimizer.SGD(), op=hvd.Adasum, gradient_predivide_factor=0.5)
    with pytest.raises(ValueError, match="argument 'op'=3 is not supported"):
        hvd.KVStore(op=hvd.Min)
    kv = hvd.KVStore(op=hvd.Adasum)
    with pytest.raises(ValueError, match="compression_params\\['type'\\]='2bit' sums quantized "
                                         "values and cannot take this store's op=hvd.Adasum"):
        kv.set_gradient_compression({"type": "2bit"})
