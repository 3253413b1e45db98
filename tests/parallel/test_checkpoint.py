"""save_checkpoint / load_checkpoint: resuming reproduces the uninterrupted
run bitwise, for DistributedTrainer and for gluon.Trainer with the kvstore
plugin; only the root needs the file; bad files and models that do not fit
raise on every rank, naming the parameter, and nothing hangs."""
import os
import pickle

import mxnet as mx
import numpy as np
import pytest
from mxnet import gluon
from mxnet.gluon import nn

import hvdmx as hvd
from conftest import world_allgather, world_bcast
from test_training import (B, HIDDEN, IN, MOMENTUM, OUT, assert_identical_across_ranks, batches,
                           local, make_net, params_numpy, train_step)

STEPS, RESUME_AT = 10, 5


def optimizer_params(kind):
    """SGD with momentum and a schedule that changes at update counts 3, 6
    and 9; Adam, whose bias correction uses each parameter's update count."""
    if kind == "sgd":
        return "sgd", {"learning_rate": 0.1, "momentum": MOMENTUM,
                       "lr_scheduler": mx.lr_scheduler.FactorScheduler(step=3, factor=0.5)}
    return "adam", {"learning_rate": 0.01}


def make_trainer(net, how, kind, prefix):
    name, opt = optimizer_params(kind)
    if how == "distributed":
        return hvd.DistributedTrainer(net.collect_params(), name, opt, prefix=prefix), B
    return gluon.Trainer(net.collect_params(), name, opt,
                         kvstore=hvd.KVStore(prefix=prefix)), hvd.size() * B


def shared_path(tmp_path, name):
    """A path in rank 0's temporary directory, the same string on every rank."""
    return world_bcast(str(tmp_path / name) if hvd.rank() == 0 else None)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("how", ["distributed", "kvstore"])
def test_resume_reproduces_the_uninterrupted_run(tmp_path, how, kind):
    xs, ys = batches(STEPS)
    # Each rank passes its own directory: only rank 0 writes and reads the file.
    path = str(tmp_path / "run.ckpt")
    net = make_net(f"ckpt{how}{kind}_")
    hvd.broadcast_parameters(net.collect_params(), root_rank=0, prefix=f"ckpt.{how}.{kind}.")
    trainer, batch = make_trainer(net, how, kind, f"ckpt.{how}.{kind}.")
    for step in range(STEPS):
        if step == RESUME_AT:
            hvd.save_checkpoint(path, net, trainer, step=step, note="half way")
        train_step(net, trainer, local(xs[step]), local(ys[step]), batch)
        assert_identical_across_ranks(net)
    uninterrupted = params_numpy(net)
    assert os.path.exists(path) == (hvd.rank() == 0)

    # A fresh model (another prefix, other initial values) and a fresh trainer.
    resumed = make_net(f"resumed{how}{kind}_", seed=99)
    trainer2, batch = make_trainer(resumed, how, kind, f"resumed.{how}.{kind}.")
    extra = hvd.load_checkpoint(path, resumed, trainer2)
    assert extra == {"step": RESUME_AT, "note": "half way"}
    assert trainer2._optimizer.num_update == trainer._optimizer.num_update - (STEPS - RESUME_AT)
    for step in range(extra["step"], STEPS):
        train_step(resumed, trainer2, local(xs[step]), local(ys[step]), batch)
    got = params_numpy(resumed)
    for key in uninterrupted:
        assert np.array_equal(got[key], uninterrupted[key]), key
    assert_identical_across_ranks(resumed)


def test_states_matter():
    """Loading parameters without the trainer's states does not reproduce the
    run: the test above would notice lost momentum or update counts."""
    xs, ys = batches(4)
    net = make_net("ckptmatter_", seed=0)
    trainer, batch = make_trainer(net, "distributed", "sgd", "ckptmatter.")
    for step in range(2):
        train_step(net, trainer, local(xs[step]), local(ys[step]), batch)
    saved = {k: mx.nd.array(v) for k, v in params_numpy(net).items()}
    for step in range(2, 4):
        train_step(net, trainer, local(xs[step]), local(ys[step]), batch)
    fresh = make_net("ckptmatter2_", seed=0)
    for key, p in fresh._collect_params_with_prefix().items():
        p.set_data(saved[key])
    trainer2, batch = make_trainer(fresh, "distributed", "sgd", "ckptmatter2.")
    for step in range(2, 4):
        train_step(fresh, trainer2, local(xs[step]), local(ys[step]), batch)
    assert not np.array_equal(params_numpy(fresh)["0.weight"], params_numpy(net)["0.weight"])


def compressed_trainer(net, holder, prefix):
    """A trainer whose gradient compression keeps a residual per rank and
    parameter, in the trainer, its DistributedOptimizer or its KVStore."""
    opt = {"learning_rate": 0.1, "momentum": MOMENTUM}
    if holder == "trainer":
        return hvd.DistributedTrainer(net.collect_params(), "sgd", opt, prefix=prefix,
                                      compression=hvd.Compression.onebit), B
    if holder == "optimizer":
        wrapped = hvd.DistributedOptimizer(mx.optimizer.create("sgd", **opt),
                                           compression=hvd.Compression.onebit)
        return gluon.Trainer(net.collect_params(), wrapped, kvstore=None), B
    kind = holder.split(":")[1]
    params = {"type": kind, "threshold": 0.01} if kind == "2bit" else {"type": kind}
    return gluon.Trainer(net.collect_params(), "sgd", opt, kvstore=hvd.KVStore(prefix=prefix),
                         compression_params=params), hvd.size() * B


def residuals_of(trainer):
    from hvdmx.checkpoint_residuals import residual_holders
    (holder,) = residual_holders(trainer).values()
    return holder


@pytest.mark.parametrize("holder", ["trainer", "optimizer", "kvstore:2bit", "kvstore:1bit"])
def test_resume_with_compression_residuals(tmp_path, holder):
    """Each rank's residuals come back to that rank: the resumed run equals
    the uninterrupted one bitwise, and it would not with the residuals lost.
    Every rank calls save_checkpoint (the residuals travel to rank 0)."""
    xs, ys = batches(STEPS)
    tag = holder.replace(":", "")
    path = str(tmp_path / "residuals.ckpt")
    net = make_net(f"ckptres{tag}_")
    hvd.broadcast_parameters(net.collect_params(), root_rank=0, prefix=f"ckptres.{tag}.")
    trainer, batch = compressed_trainer(net, holder, f"ckptres.{tag}.")
    for step in range(STEPS):
        if step == RESUME_AT:
            hvd.save_checkpoint(path, net, trainer, step=step)
            saved = {i: r.asnumpy() for i, r in residuals_of(trainer).items()}
        train_step(net, trainer, local(xs[step]), local(ys[step]), batch)
        assert_identical_across_ranks(net)
    uninterrupted = params_numpy(net)
    if hvd.size() > 1:  # the residuals differ by rank, so each must get its own
        assert len(saved) == 4
        mine = np.concatenate([saved[i].ravel() for i in sorted(saved)])
        everyone = world_allgather(mine)
        assert not all(np.array_equal(everyone[0], other) for other in everyone[1:])

    def resume(label, lose_residuals=False):
        resumed = make_net(f"{label}{tag}_", seed=99)
        trainer2, batch = compressed_trainer(resumed, holder, f"{label}.{tag}.")
        hvd.load_checkpoint(path, resumed, trainer2)
        if hvd.size() > 1:
            got = residuals_of(trainer2)
            assert sorted(got) == sorted(saved)
            assert all(np.array_equal(got[i].asnumpy(), saved[i]) for i in saved)
        if lose_residuals:
            residuals_of(trainer2).clear()
        for step in range(RESUME_AT, STEPS):
            train_step(resumed, trainer2, local(xs[step]), local(ys[step]), batch)
        assert_identical_across_ranks(resumed)
        return params_numpy(resumed)

    got = resume("ckptresumed")
    for key in uninterrupted:
        assert np.array_equal(got[key], uninterrupted[key]), key
    if hvd.size() > 1:
        lost = resume("ckptlost", lose_residuals=True)
        assert not all(np.array_equal(lost[k], uninterrupted[k]) for k in uninterrupted)


def test_residuals_of_another_job_size_are_not_loaded(tmp_path):
    """A checkpoint whose residuals were saved by another number of ranks
    loads everything else, warns on every rank, and starts the residuals
    at zero."""
    xs, ys = batches(2)
    path = shared_path(tmp_path, "othersize.ckpt")
    net = make_net("ckptsize_")
    hvd.broadcast_parameters(net.collect_params(), root_rank=0, prefix="ckptsize.")
    trainer, batch = compressed_trainer(net, "trainer", "ckptsize.")
    train_step(net, trainer, local(xs[0]), local(ys[0]), batch)
    hvd.save_checkpoint(path, net, trainer)
    if hvd.rank() == 0:  # as if written by a job of one more rank
        arrays = mx.nd.load(path)
        meta = pickle.loads(arrays["hvdmx.checkpoint"].asnumpy().tobytes())
        if hvd.size() > 1:
            assert meta["residuals"]["ranks"] == hvd.size()
            meta["residuals"]["ranks"] = hvd.size() + 1
        else:
            assert "residuals" not in meta  # one rank sends nothing, keeps nothing
        blob = np.frombuffer(pickle.dumps(meta), dtype=np.uint8)
        arrays["hvdmx.checkpoint"] = mx.nd.array(blob, dtype="uint8")
        mx.nd.save(path, arrays)
    resumed = make_net("ckptsize2_", seed=99)
    trainer2, _ = compressed_trainer(resumed, "trainer", "ckptsize2.")
    if hvd.size() > 1:
        with pytest.warns(UserWarning, match=f"residuals of {hvd.size() + 1} ranks and this "
                                             f"job has {hvd.size()}; they were not loaded"):
            hvd.load_checkpoint(path, resumed, trainer2)
    else:
        hvd.load_checkpoint(path, resumed, trainer2)
    assert residuals_of(trainer2) == {}
    assert params_numpy(resumed)["0.weight"].tolist() == params_numpy(net)["0.weight"].tolist()


def test_every_root_and_plain_dicts(tmp_path):
    """A dict of NDArrays (Module's arg_params) from every root rank; the
    other ranks' arrays start different and end with the saved values."""
    r = hvd.rank()
    path = shared_path(tmp_path, "plain.ckpt")
    saved = {"w": mx.nd.arange(7, dtype="float32") * 3, "b": mx.nd.array([5, 6], dtype="int64")}
    hvd.save_checkpoint(path, saved, epoch=4)
    for root in range(hvd.size()):
        arrays = {"w": mx.nd.zeros((7,)) + r, "b": mx.nd.zeros((2,), dtype="int64")}
        extra = hvd.load_checkpoint(path, arrays, root_rank=root)
        assert extra == {"epoch": 4}
        for key, value in saved.items():
            assert arrays[key].dtype == value.dtype
            assert np.array_equal(arrays[key].asnumpy(), value.asnumpy()), (root, key)


def test_load_into_a_deferred_model(tmp_path):
    """A model whose shapes are not known yet takes them from the checkpoint."""
    path = str(tmp_path / "deferred.ckpt")
    net = make_net("ckptdeferred_", seed=3)
    hvd.save_checkpoint(path, net)
    fresh = make_net("ckptdeferred2_", deferred=True)
    hvd.load_checkpoint(path, fresh)
    want = make_net("ckptdeferred3_", seed=3)
    for key, value in params_numpy(want).items():
        assert np.array_equal(params_numpy(fresh)[key], value), key


# --- bad input ---------------------------------------------------------------

def test_unreadable_or_foreign_files(tmp_path):
    """Every rank raises the root's error; only the root looks at the path."""
    missing = str(tmp_path / "no-such.ckpt")
    net = make_net("ckptbadfile_")
    with pytest.raises(FileNotFoundError, match="rank 0 cannot read the checkpoint.*no-such.ckpt"):
        hvd.load_checkpoint(missing, net)
    plain = shared_path(tmp_path, "plain.params")
    if hvd.rank() == 0:
        net.save_parameters(plain)
    with pytest.raises(ValueError, match="is not an hvdmx checkpoint.*net.load_parameters"):
        hvd.load_checkpoint(plain, net)
    garbage = shared_path(tmp_path, "garbage.ckpt")
    if hvd.rank() == 0:
        with open(garbage, "wb") as f:
            f.write(b"not an ndarray file" * 8)
    with pytest.raises(ValueError, match="garbage.ckpt' is not an MXNet NDArray file"):
        hvd.load_checkpoint(garbage, net)
    out = hvd.allreduce(mx.nd.ones((3,)), op=hvd.Sum, name="after.ckptbadfile")
    assert out.asnumpy().tolist() == [hvd.size()] * 3


def other_model(prefix, hidden=HIDDEN, extra_layer=False):
    net = nn.HybridSequential(prefix=prefix)
    with net.name_scope():
        net.add(nn.Dense(hidden, in_units=IN, activation="tanh"))
        net.add(nn.Dense(OUT, in_units=hidden))
        if extra_layer:
            net.add(nn.Dense(OUT, in_units=OUT))
    net.initialize()
    return net


def test_model_that_does_not_fit(tmp_path):
    path = shared_path(tmp_path, "fit.ckpt")
    net = make_net("ckptfit_")
    hvd.save_checkpoint(path, net)
    with pytest.raises(ValueError, match=r"parameter '0.bias' is \(8,\) float32 in "
                                         r"checkpoint .* but \(9,\) float32 in the model"):
        hvd.load_checkpoint(path, other_model("ckptfit9_", hidden=HIDDEN + 1))
    with pytest.raises(ValueError, match="parameter '2.bias' of the model is not in checkpoint"):
        hvd.load_checkpoint(path, other_model("ckptfitextra_", extra_layer=True))
    smaller = nn.Dense(HIDDEN, in_units=IN, prefix="ckptfitsmall_")
    smaller.initialize()
    with pytest.raises(ValueError, match="has parameter '1.bias', which the model does not"):
        hvd.load_checkpoint(path, {"0.weight": smaller.weight, "0.bias": smaller.bias,
                                   "1.weight": smaller.weight})
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    with pytest.raises(ValueError, match="has no trainer state .* trainer=None"):
        hvd.load_checkpoint(path, net, trainer)
    before = params_numpy(net)
    if hvd.size() > 1:
        # Only the last rank's model differs: it names the parameter, the
        # others name that rank; nothing is loaded anywhere.
        last = hvd.rank() == hvd.size() - 1
        model = other_model("ckptfitlast_", hidden=HIDDEN + (1 if last else 0))
        want = "parameter '0.bias' is" if last else \
            rf"rank\(s\) \[{hvd.size() - 1}\] cannot load checkpoint"
        with pytest.raises(ValueError, match=want):
            hvd.load_checkpoint(path, model)
    after = params_numpy(net)
    assert all(np.array_equal(before[k], after[k]) for k in before)
    out = hvd.allreduce(mx.nd.ones((3,)), op=hvd.Sum, name="after.ckptfit")
    assert out.asnumpy().tolist() == [hvd.size()] * 3


def test_bad_arguments(tmp_path):
    net = make_net("ckptargs_")
    n = hvd.size()
    with pytest.raises(TypeError, match="'params' must be a gluon Block.*got list"):
        hvd.save_checkpoint(str(tmp_path / "x"), [net])
    with pytest.raises(TypeError, match="'trainer' must be a gluon.Trainer.*got str"):
        hvd.load_checkpoint(str(tmp_path / "x"), net, "sgd")
    with pytest.raises(ValueError, match=f"'root_rank'={n} is out of range"):
        hvd.load_checkpoint(str(tmp_path / "x"), net, root_rank=n)
    with pytest.raises(TypeError, match="'path' must be a str or a path, got int"):
        hvd.load_checkpoint(3, net)
    with pytest.raises(TypeError, match=r"params\['w'\] must be a Parameter or an NDArray"):
        hvd.save_checkpoint(str(tmp_path / "x"), {"w": [1.0]})
    other = make_net("ckptargsother_")
    trainer = hvd.DistributedTrainer(other.collect_params(), "sgd", {"learning_rate": 0.1})
    with pytest.raises(ValueError, match="trainer's parameter 'ckptargsother_dense0_bias' is "
                                         "not among argument 'params'"):
        hvd.save_checkpoint(str(tmp_path / "x"), net, trainer)
    # Only rank 0 writes, so only rank 0 can fail to.
    nowhere = str(tmp_path / "no-such-dir" / "x.ckpt")
    if hvd.rank() == 0:
        with pytest.raises(OSError, match="cannot write .*no-such-dir.*directory exists"):
            hvd.save_checkpoint(nowhere, net)
        with pytest.raises(TypeError, match="every 'extra' value must be picklable"):
            hvd.save_checkpoint(str(tmp_path / "x"), net, hook=lambda: 0)
    else:
        assert hvd.save_checkpoint(nowhere, net) is None
    assert not os.path.exists(str(tmp_path / "x"))
