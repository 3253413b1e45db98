"""Compression.onebit (Note [One-bit compression] in csrc/hvdmx/algorithms/onebit.h):
the exchange against a numpy model of it, bit for bit, the error feedback,
and training with it."""
import numpy as np
import mxnet as mx
import pytest
from mxnet import autograd, gluon

import hvdmx as hvd
from conftest import all_equal_across_ranks
from helpers import mnist_example_accuracy

# Sizes that break naive packing: one value, a word or chunk boundary on either
# side, and a large count that is no multiple of either. (MXNet makes no empty arrays
# outside its numpy mode, and no parameter is empty.)
SIZES = [1, 31, 32, 33, 255, 256, 257, 1000, 100003]


def gradient(rank, step, n):
    """Rank- and step-dependent values of both signs, some exactly 0."""
    i = np.arange(n, dtype=np.float64)
    return (np.sin(i * 0.37 + rank * 1.3 + step * 0.71) * (rank + 1) * 0.5).round(2) \
        .astype(np.float32)


CHUNK = 256  # kOneBitChunk


def sequential_mean(values):
    """The mean as OneBitPack computes it: summed in float64 in index order."""
    return np.float32(np.cumsum(values.astype(np.float64))[-1] / len(values)) if len(values) \
        else np.float32(0)


def model_pack(g, residual):
    """numpy's version of OneBitPack: the values sent and the new residual."""
    r = residual + g
    sent = np.empty_like(r)
    for c in range(0, len(r), CHUNK):
        chunk = r[c:c + CHUNK]
        positive = chunk >= 0
        sent[c:c + CHUNK] = np.where(positive, sequential_mean(chunk[positive]),
                                     sequential_mean(chunk[~positive]))
    return sent, (r - sent).astype(np.float32)


@pytest.mark.parametrize("n", SIZES)
def test_onebit_exchange_matches_the_model_bit_for_bit(n):
    rank, size = hvd.rank(), hvd.size()
    residuals = [np.zeros(n, np.float32) for _ in range(size)]
    grad = mx.nd.zeros((n,))
    residual = mx.nd.zeros((n,))
    for step in range(3):
        grad[:] = gradient(rank, step, n)
        hvd.Compression.onebit.exchange(grad, residual, f"onebit.model.{n}",
                                        hvd.global_process_set)
        expect = np.zeros(n, np.float32)
        for r in range(size):  # every rank's sent values, added in rank order
            sent, residuals[r] = model_pack(gradient(r, step, n), residuals[r])
            expect += sent
        assert np.array_equal(grad.asnumpy().view(np.uint32), expect.view(np.uint32))
        assert np.array_equal(residual.asnumpy().view(np.uint32),
                              residuals[rank].view(np.uint32))
        assert all_equal_across_ranks(grad.asnumpy())


def test_onebit_error_feedback_loses_nothing():
    # Over the steps, what every rank sent plus what every rank still holds
    # equals the sum of all the gradients, to float32 rounding: relative to
    # the magnitude of what was added up, so the bound does not grow with
    # the number of ranks or steps.
    rank, size = hvd.rank(), hvd.size()
    n, steps = 4099, 6
    grad = mx.nd.zeros((n,))
    residual = mx.nd.zeros((n,))
    received = np.zeros(n, np.float64)
    true = np.zeros(n, np.float64)
    magnitude = 0.0
    for step in range(steps):
        grad[:] = gradient(rank, step, n)
        hvd.Compression.onebit.exchange(grad, residual, "onebit.feedback",
                                        hvd.global_process_set)
        received += grad.asnumpy()
        true += sum(gradient(r, step, n).astype(np.float64) for r in range(size))
        magnitude += sum(np.abs(gradient(r, step, n)).max() for r in range(size))
    held = hvd.allreduce(residual, op=hvd.Sum, name="onebit.feedback.held").asnumpy()
    np.testing.assert_allclose(received + held, true, rtol=0, atol=1e-6 * magnitude)
    # and compression really happened: the sent values are levels, not the gradients
    assert not np.allclose(received, true, atol=1e-2)


def test_trainer_with_onebit_keeps_the_ranks_identical_and_refuses_other_dtypes():
    net = gluon.nn.Dense(3, in_units=5, prefix="onebit.net.")
    net.initialize(mx.init.Uniform(0.5))
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                                     compression=hvd.Compression.onebit, prefix="onebit.t.")
    rng = np.random.RandomState(hvd.rank())
    for _ in range(3):
        x = mx.nd.array(rng.uniform(-1, 1, (4, 5)))
        with autograd.record():
            loss = (net(x) ** 2).sum()
        loss.backward()
        trainer.step(4)
    for p in net.collect_params().values():
        assert all_equal_across_ranks(p.data().asnumpy())
    assert set(trainer._residuals) == ({0, 1} if hvd.size() > 1 else set())
    half = gluon.Parameter("onebit.half.w", shape=(3,), dtype="float16")
    half.initialize()
    trainer = hvd.DistributedTrainer([half], "sgd", {"learning_rate": 0.1},
                                     compression=hvd.Compression.onebit, prefix="onebit.h.")
    with autograd.record():
        loss = (half.data() * mx.nd.ones((3,), dtype="float16")).sum()
    loss.backward()
    if hvd.size() > 1:
        with pytest.raises(TypeError, match="Compression.onebit needs float32 gradients on "
                                            "the CPU; the gradient of 'onebit.half.w' is "
                                            "float16"):
            trainer.step(2)
    with pytest.raises(TypeError, match="Compression.onebit keeps a residual"):
        hvd.Compression.onebit.compress(mx.nd.ones((2,)))


@pytest.mark.skipif(hvd.size() != 2, reason="the accuracy target is for 2 ranks")
def test_mnist_example_with_onebit_reaches_the_accuracy():
    accuracy = mnist_example_accuracy(["--compression", "onebit", "--log-interval", "1000"])
    assert accuracy >= 0.95  # its final check raises if the ranks' parameters differ


def test_distributed_optimizer_with_onebit():
    rank, size = hvd.rank(), hvd.size()
    n = 300
    opt = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=1.0, rescale_grad=1.0),
                                   compression=hvd.Compression.onebit)
    weight = mx.nd.zeros((n,))
    expect = np.zeros(n, np.float32)
    residuals = [np.zeros(n, np.float32) for _ in range(size)]
    for step in range(2):
        grad = mx.nd.array(gradient(rank, step, n))
        opt.update(0, weight, grad, opt.create_state(0, weight))
        total = np.zeros(n, np.float32)
        for r in range(size):
            sent, residuals[r] = model_pack(gradient(r, step, n), residuals[r])
            total += sent
        if size == 1:  # nothing is sent, so nothing is compressed
            total = gradient(rank, step, n)
        expect -= total / size
        np.testing.assert_allclose(weight.asnumpy(), expect, rtol=1e-6, atol=1e-6)
        assert all_equal_across_ranks(weight.asnumpy())
    if size > 1:
        assert np.array_equal(opt._residuals[0].asnumpy(), residuals[rank])
    with pytest.raises(ValueError, match="'compression'=.*is not supported; use "
                                         "hvd.Compression.none or hvd.Compression.onebit"):
        hvd.DistributedOptimizer(mx.optimizer.SGD(), compression=hvd.Compression.fp16)
    with pytest.raises(ValueError, match="leave 'num_groups' at 0"):
        hvd.DistributedOptimizer(mx.optimizer.SGD(), compression=hvd.Compression.onebit,
                                 num_groups=2)
