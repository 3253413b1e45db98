"""DistributedTrainer, DistributedOptimizer and broadcast_parameters on a
process set: the even and the odd ranks train two models at once, each equal
to one process training on its set's whole batch."""
import mxnet as mx
import numpy as np
import pytest

import hvdmx as hvd
from conftest import world_allgather, world_barrier
from test_training import (B, LR, MOMENTUM, assert_close, batches, copy_params, make_net,
                           params_numpy, train_step)
from mxnet import gluon


@pytest.fixture
def my_half(world):
    """This rank's set (even or odd ranks), registered on every rank."""
    rank, size = world
    sets = [hvd.add_process_set(list(range(0, size, 2)))]
    if size > 1:
        sets.append(hvd.add_process_set(list(range(1, size, 2))))
    yield sets[rank % 2]
    for ps in sets:
        hvd.remove_process_set(ps)


def rows(a, members):
    return np.concatenate([a[r * B:(r + 1) * B] for r in members])


@pytest.mark.parametrize("split", [False, True])
def test_trainer_on_a_process_set(world, my_half, split):
    rank, size = world
    members = my_half.ranks
    net = make_net(f"psnet{int(split)}_")  # rank-dependent: the broadcast must fix it
    hvd.broadcast_parameters(net.collect_params(), root_rank=members[-1],
                             process_set=my_half)
    ref = make_net(f"psref{int(split)}_")
    copy_params(net, ref)
    opt = {"learning_rate": LR, "momentum": MOMENTUM}
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", dict(opt),
                                     process_set=my_half)
    assert trainer._scale == pytest.approx(1.0 / len(members))
    ref_trainer = gluon.Trainer(ref.collect_params(), "sgd", dict(opt), kvstore=None)
    xs, ys = batches(10)
    for step in range(10):
        x, y = xs[step], ys[step]
        train_step(net, trainer, x[rank * B:(rank + 1) * B], y[rank * B:(rank + 1) * B], B,
                   split=split)
        train_step(ref, ref_trainer, rows(x, members), rows(y, members), len(members) * B)
        for key, value in params_numpy(net).items():
            data = value.tobytes()
            everyone = world_allgather(data)
            assert all(everyone[r] == data for r in members), key
    assert_close(params_numpy(net), params_numpy(ref), rtol=1e-5)


def test_distributed_optimizer_on_a_process_set(world, my_half):
    rank, size = world
    members = my_half.ranks
    grad = mx.nd.full((3,), rank + 1.0)
    weight = mx.nd.zeros((3,))
    opt = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=1.0, rescale_grad=1.0),
                                   process_set=my_half)
    opt.update(0, weight, grad, None)
    mean = np.mean([r + 1.0 for r in members])
    assert weight.asnumpy().tolist() == pytest.approx([-mean] * 3)


def test_process_set_argument_errors(world):
    rank, size = world
    net = make_net("psbad_")
    with pytest.raises(TypeError, match="'process_set' must be a ProcessSet"):
        hvd.DistributedTrainer(net.collect_params(), "sgd", process_set=[0])
    with pytest.raises(ValueError, match="is not registered"):
        hvd.DistributedOptimizer(mx.optimizer.SGD(), process_set=hvd.ProcessSet([0]))
    with pytest.raises(ValueError, match="'root_rank'=.* is out of range"):
        hvd.broadcast_parameters(net.collect_params(), root_rank=size)


def count_pushes(monkeypatch):
    """Counts the collectives this rank hands to the core from now on."""
    pushed = []
    for fn in ("push_async", "push_allreduce_each", "negotiate"):
        real = getattr(hvd.ops._core, fn)
        monkeypatch.setattr(hvd.ops._core, fn,
                            lambda _real=real, _fn=fn, **k: pushed.append(_fn) or _real(**k))
    return pushed


def one_step(kind, ps, rank, f):
    """One SGD step (learning rate 1) of a 3-element weight from 0 with the
    gradient rank + 1, through `kind` on `ps`; returns the weight."""
    if kind == "optimizer":
        opt = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=1.0, rescale_grad=1.0),
                                       gradient_predivide_factor=f, process_set=ps)
        weight = mx.nd.zeros((3,))
        opt.update(0, weight, mx.nd.full((3,), rank + 1.0), None)
        return weight.asnumpy()
    w = gluon.Parameter("w", shape=(3,), init=mx.init.Zero())
    w.initialize()
    trainer = hvd.DistributedTrainer([w], "sgd", {"learning_rate": 1.0},
                                     gradient_predivide_factor=f, process_set=ps)
    with mx.autograd.record():
        loss = (w.data() * (rank + 1.0)).sum()
    loss.backward()
    trainer.step(1)
    return w.data().asnumpy()


@pytest.mark.parametrize("kind", ["optimizer", "trainer"])
def test_a_rank_outside_the_set_sends_nothing_and_steps_alone(world, monkeypatch, kind):
    # Horovod reduces only where process_set.included(); elsewhere the update
    # applies the rank's own gradient, scaled by f / set size. A set of one
    # sends nothing either: its rank averages over itself. f = 2 makes each
    # case's result different; the values stay exact.
    rank, size = world
    sets = [[0]] + ([[0, 1]] if size >= 3 else [])
    for members in sets:
        ps = hvd.add_process_set(members)
        # Nothing waits for a rank outside a set of one: the other ranks
        # start their step only after rank 0 has finished its own.
        if members == [0] and rank > 0:
            world_barrier()  # rank 0 meets it once done
        pushed = count_pushes(monkeypatch)
        got = one_step(kind, ps, rank, 2.0)
        monkeypatch.undo()
        if members == [0] and rank == 0:
            world_barrier()
        if rank not in members:
            want, sent = -(rank + 1.0) * 2.0 / len(members), False
        elif len(members) == 1:
            want, sent = -(rank + 1.0), False
        else:
            want, sent = -np.mean([m + 1.0 for m in members]), True
        assert got.tolist() == [want] * 3, (members, got)
        assert bool(pushed) == sent, (members, pushed)
        hvd.remove_process_set(ps)
