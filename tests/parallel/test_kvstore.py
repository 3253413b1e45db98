"""The kvstore plugin: gluon.Trainer and Module with kvstore=hvd.KVStore(),
checked against one process training the same model on the whole batch
(the helpers and the model are test_training's), and the store's own calls
with exact integer-valued data."""
import warnings

import mxnet as mx
import numpy as np
import pytest
from mxnet import gluon

import hvdmx as hvd
from conftest import all_equal_across_ranks
from helpers import mixed
from test_training import (B, IN, LR, MOMENTUM, OUT, assert_close, assert_identical_across_ranks,
                           batches, copy_params, local, make_net, module_mlp, params_numpy,
                           train_step)

OPT = {"learning_rate": LR, "momentum": MOMENTUM}


def kvstore_and_reference(prefix, ctxs=None, broadcast=True, **store_kwargs):
    """A net trained by gluon.Trainer through an hvdmx.KVStore, and a
    same-valued reference net with a plain gluon.Trainer, kvstore=None."""
    net = make_net(prefix)
    if ctxs:
        net.collect_params().reset_ctx(ctxs)
    if broadcast:
        hvd.broadcast_parameters(net.collect_params(), root_rank=0, prefix=prefix)
    store = hvd.KVStore(prefix=prefix, **store_kwargs)
    trainer = gluon.Trainer(net.collect_params(), "sgd", dict(OPT), kvstore=store)
    ref = make_net("ref_" + prefix)
    copy_params(net, ref)
    ref_trainer = gluon.Trainer(ref.collect_params(), "sgd", dict(OPT), kvstore=None)
    return net, trainer, ref, ref_trainer


def test_trainer_data_parallel_equivalence():
    """20 steps of SGD with momentum; step() gets the whole job's batch size,
    as for MXNet's dist_sync store."""
    steps, n = 20, hvd.size()
    net, trainer, ref, ref_trainer = kvstore_and_reference("kveq_")
    xs, ys = batches(steps)
    for step in range(steps):
        train_step(net, trainer, local(xs[step]), local(ys[step]), n * B)
        train_step(ref, ref_trainer, xs[step], ys[step], n * B)
        assert_identical_across_ranks(net)
    assert_close(params_numpy(net), params_numpy(ref), rtol=1e-5)
    assert isinstance(trainer._kvstore, hvd.KVStore)
    assert trainer._update_on_kvstore is False  # the optimizer runs in the trainer


def test_trainer_allreduce_grads_then_update():
    steps, n = 5, hvd.size()
    net, trainer, ref, ref_trainer = kvstore_and_reference("kvsplit_")
    xs, ys = batches(steps)
    for step in range(steps):
        train_step(net, trainer, local(xs[step]), local(ys[step]), n * B, split=True)
        train_step(ref, ref_trainer, xs[step], ys[step], n * B)
    assert_identical_across_ranks(net)
    assert_close(params_numpy(net), params_numpy(ref), rtol=1e-5)


def test_trainer_broadcasts_parameters_at_its_first_step():
    """Without broadcast_parameters the ranks start apart; the trainer's
    first step gives them rank 0's parameters (after that step's gradients)."""
    net = make_net("kvinit_")  # rank-dependent values
    if hvd.size() > 1:
        assert not all_equal_across_ranks(params_numpy(net)["0.weight"])
    trainer = gluon.Trainer(net.collect_params(), "sgd", dict(OPT),
                            kvstore=hvd.KVStore(prefix="kvinit_"))
    xs, ys = batches(2)
    for step in range(2):
        train_step(net, trainer, local(xs[step]), local(ys[step]), hvd.size() * B)
        assert_identical_across_ranks(net)


def test_two_contexts_per_rank():
    """pushpull sums over the rank's devices too; step() gets the job's batch."""
    steps, n, ctxs = 5, hvd.size(), [mx.cpu(0), mx.cpu(1)]
    net, trainer, ref, ref_trainer = kvstore_and_reference("kvtwoctx_", ctxs=ctxs)
    xs, ys = batches(steps)
    loss_fn = gluon.loss.L2Loss()
    for step in range(steps):
        x, y = local(xs[step]), local(ys[step])
        with mx.autograd.record():
            losses = [loss_fn(net(mx.nd.array(x[h::2], ctx=c)), mx.nd.array(y[h::2], ctx=c))
                      for h, c in enumerate(ctxs)]
        mx.autograd.backward(losses)
        trainer.step(n * B)
        train_step(ref, ref_trainer, xs[step], ys[step], n * B)
    for p in net.collect_params().values():
        first, second = (d.asnumpy() for d in p.list_data())
        assert np.array_equal(first, second), p.name
    assert_identical_across_ranks(net)
    assert_close(params_numpy(net), params_numpy(ref), rtol=1e-5)


def test_fp16_compression_stays_close():
    steps, n = 5, hvd.size()
    net, trainer, ref, ref_trainer = kvstore_and_reference(
        "kvfp16_", compression=hvd.Compression.fp16)
    xs, ys = batches(steps)
    for step in range(steps):
        train_step(net, trainer, local(xs[step]), local(ys[step]), n * B)
        train_step(ref, ref_trainer, xs[step], ys[step], n * B)
        assert_identical_across_ranks(net)
    got, want = params_numpy(net), params_numpy(ref)
    for key in want:  # float16 gradients: see test_training's fp16 test
        assert np.max(np.abs(got[key] - want[key])) < 1e-3, key


def test_created_by_name():
    """mx.kv.create and gluon.Trainer find the store by its registered name,
    also with one device (a name without 'dist' would be dropped there)."""
    store = mx.kv.create("dist_sync_hvdmx")
    assert isinstance(store, hvd.KVStore)
    assert store.type == "dist_sync_hvdmx"
    assert (store.rank, store.num_workers) == (hvd.rank(), hvd.size())
    assert store.is_capable("optimizer") is False
    net = make_net("kvbyname_")
    hvd.broadcast_parameters(net.collect_params(), root_rank=0, prefix="kvbyname.")
    trainer = gluon.Trainer(net.collect_params(), "sgd", dict(OPT), kvstore="dist_sync_hvdmx")
    xs, ys = batches(1)
    train_step(net, trainer, local(xs[0]), local(ys[0]), hvd.size() * B)
    assert isinstance(trainer._kvstore, hvd.KVStore)
    assert_identical_across_ranks(net)


def test_module_equivalence():
    """Module scales by the job's batch by itself (the store's type says
    dist_sync), and pushes gradients under string keys."""
    steps = 8
    rng = np.random.RandomState(hvd.rank())
    shapes = {"fc1_weight": (8, IN), "fc1_bias": (8,), "fc2_weight": (OUT, 8), "fc2_bias": (OUT,)}
    arg_params = {k: mx.nd.array(rng.uniform(-0.5, 0.5, s)) for k, s in shapes.items()}
    hvd.broadcast_parameters(arg_params, root_rank=0, prefix="kvmodule.")
    opt = (("learning_rate", LR), ("momentum", MOMENTUM))
    mod = mx.mod.Module(module_mlp(), data_names=["data"], label_names=["label"])
    mod.bind(data_shapes=[("data", (B, IN))], label_shapes=[("label", (B, OUT))])
    mod.init_params(arg_params={k: v.copy() for k, v in arg_params.items()})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mod.init_optimizer(kvstore=hvd.KVStore(prefix="kvmodule."), optimizer="sgd",
                           optimizer_params=opt)
    assert mod._optimizer.rescale_grad == pytest.approx(1.0 / (hvd.size() * B))
    ref = mx.mod.Module(module_mlp(), data_names=["data"], label_names=["label"])
    ref.bind(data_shapes=[("data", (hvd.size() * B, IN))],
             label_shapes=[("label", (hvd.size() * B, OUT))])
    ref.init_params(arg_params={k: v.copy() for k, v in arg_params.items()})
    ref.init_optimizer(kvstore=None, optimizer="sgd", optimizer_params=opt)
    xs, ys = batches(steps)
    for step in range(steps):
        for m, x, y in ((mod, local(xs[step]), local(ys[step])), (ref, xs[step], ys[step])):
            m.forward_backward(mx.io.DataBatch([mx.nd.array(x)], [mx.nd.array(y)]))
            m.update()
        for value in mod.get_params()[0].values():
            assert all_equal_across_ranks(value.asnumpy())
    got, want = mod.get_params()[0], ref.get_params()[0]
    for key in want:
        np.testing.assert_allclose(got[key].asnumpy(), want[key].asnumpy(), rtol=1e-5,
                                   atol=1e-7, err_msg=key)


# --- the store's own calls ---------------------------------------------------

def ramp(shape, r, k=0):
    """Integer-valued float32 data that depends on rank r and key k."""
    n = int(np.prod(shape))
    return mixed(r, n, salt=k).reshape(shape).astype(np.float32)


def sum_over_ranks(shape, k=0):
    return sum(ramp(shape, r, k) for r in range(hvd.size()))


def test_pushpull_keys_values_and_outs():
    r = hvd.rank()
    store = hvd.KVStore(prefix="kvcalls.")
    shape = (3, hvd.size() + 1)
    # int key, one array, in place
    a = mx.nd.array(ramp(shape, r, 1))
    store.pushpull(1, a)
    assert np.array_equal(a.asnumpy(), sum_over_ranks(shape, 1))
    # str key, two devices, in place: the sum over both and over ranks, on both
    two = [mx.nd.array(ramp(shape, r, 2), ctx=mx.cpu(0)), mx.nd.array(ramp(shape, r, 3),
                                                                     ctx=mx.cpu(1))]
    store.pushpull("w", two)
    want = sum_over_ranks(shape, 2) + sum_over_ranks(shape, 3)
    for arr in two:
        assert np.array_equal(arr.asnumpy(), want)
    # out given: the value is only read
    v = mx.nd.array(ramp(shape, r, 4))
    outs = [mx.nd.zeros(shape), mx.nd.zeros(shape, ctx=mx.cpu(1))]
    store.pushpull("v", v, out=outs, priority=-3)
    for o in outs:
        assert np.array_equal(o.asnumpy(), sum_over_ranks(shape, 4))
    assert np.array_equal(v.asnumpy(), ramp(shape, r, 4))
    # a list of keys, with a list of values
    xs = [mx.nd.array(ramp((k + 1,), r, k)) for k in range(3)]
    store.pushpull([10, 11, 12], xs)
    for k, x in enumerate(xs):
        assert np.array_equal(x.asnumpy(), sum_over_ranks((k + 1,), k))
    # fp16 on the wire, float32 in and out: small integers survive exactly
    half = hvd.KVStore(compression=hvd.Compression.fp16, prefix="kvcalls.fp16.")
    h = mx.nd.array(ramp(shape, r, 5))
    half.pushpull(0, h)
    assert h.dtype == np.float32 and np.array_equal(h.asnumpy(), sum_over_ranks(shape, 5))


def test_broadcast_from_rank_0():
    r = hvd.rank()
    store = hvd.KVStore(prefix="kvbcast.")
    shape = (2, hvd.size() + 1)
    value = mx.nd.array(ramp(shape, r))
    outs = [value, mx.nd.zeros(shape, ctx=mx.cpu(1))]
    store.broadcast(0, value, outs)
    for o in outs:
        assert np.array_equal(o.asnumpy(), ramp(shape, 0))
    # 'value' not among the outputs: it keeps its own value
    value = mx.nd.array(ramp(shape, r, 1))
    out = mx.nd.zeros(shape)
    store.broadcast("k", value, out)
    assert np.array_equal(out.asnumpy(), ramp(shape, 0, 1))
    assert np.array_equal(value.asnumpy(), ramp(shape, r, 1))
    store.init("anything", value)  # no store to fill
    assert np.array_equal(value.asnumpy(), ramp(shape, r, 1))


def test_bad_input():
    store = hvd.KVStore(prefix="kvbad.")
    x = mx.nd.ones((2, 3))
    with pytest.raises(TypeError, match="'key' must be an int or a str.*1.5"):
        store.pushpull(1.5, x)
    with pytest.raises(TypeError, match="'key' must be an int or a str.*True"):
        store.pushpull(True, x)
    with pytest.raises(TypeError, match=r"'value\[1\]' must be an mxnet.nd.NDArray, got list"):
        store.pushpull(0, [x, [1.0]])
    with pytest.raises(ValueError, match="'value' is an empty list"):
        store.pushpull(0, [])
    with pytest.raises(ValueError, match=r"'value\[1\]' has shape \(3,\), but the value has "
                                         r"shape \(2, 3\)"):
        store.pushpull(0, [x, mx.nd.ones((3,))])
    with pytest.raises(ValueError, match=r"'out' has shape \(6,\)"):
        store.pushpull(0, x, out=mx.nd.ones((6,)))
    with pytest.raises(ValueError, match="list of 2 keys, argument 'value' must be a list of "
                                         "as many"):
        store.pushpull([0, 1], [x])
    with pytest.raises(TypeError, match="'priority' must be an int, got True"):
        store.pushpull(0, x, priority=True)
    with pytest.raises(ValueError, match="sparse NDArray.*dense arrays only"):
        store.pushpull(0, x.tostype("row_sparse"))
    with pytest.raises(TypeError, match="'out' must be an NDArray"):
        store.broadcast(0, x, None)
    with pytest.raises(ValueError, match="unknown capability 'bogus'"):
        store.is_capable("bogus")
    for call in (lambda: store.push(0, x), lambda: store.pull(0, x),
                 lambda: store.row_sparse_pull(0, x, row_ids=mx.nd.zeros((1,)))):
        with pytest.raises(NotImplementedError, match="use dense parameters"):
            call()
    with pytest.raises(NotImplementedError, match="keeps no optimizer.*update_on_kvstore"):
        store.set_optimizer(mx.optimizer.SGD())
    with pytest.raises(NotImplementedError, match="hvd.save_checkpoint"):
        store.save_optimizer_states("states")
    with pytest.raises(NotImplementedError, match="hvd.load_checkpoint"):
        store.load_optimizer_states("states")
    with pytest.raises(TypeError, match="'compression' must be"):
        hvd.KVStore(compression="fp16")
    with pytest.raises(TypeError, match="'prefix' must be a str or None, got int"):
        hvd.KVStore(prefix=1)
    params = make_net("kvbadtrainer_").collect_params()
    with pytest.raises(ValueError, match="\\['threshold'\\]=-1.0 must be a finite number > 0"):
        trainer = gluon.Trainer(params, "sgd", kvstore=store,
                                compression_params={"type": "2bit", "threshold": -1.0})
        trainer._init_kvstore()
    fn = "hvdmx.KVStore.set_gradient_compression"
    for bad, message in [
            ({"type": "3bit"}, "\\['type'\\]='3bit' is not supported; use '2bit'"),
            ({"threshold": 0.5}, "\\['type'\\]=None is not supported"),
            ({"type": "2bit", "threshold": 0}, "\\['threshold'\\]=0 must be a finite number > 0"),
            ({"type": "2bit", "threshold": float("nan")}, "\\['threshold'\\]=nan must be"),
            ({"type": "1bit", "threshold": 0.5}, "'threshold'\\] does not apply to '1bit'"),
            ({"type": "2bit", "thresh": 1}, "unknown compression_params \\['thresh'\\]")]:
        with pytest.raises(ValueError, match=f"{fn}: .*{message}"):
            hvd.KVStore().set_gradient_compression(bad)
    with pytest.raises(TypeError, match="'compression_params' must be a dict"):
        hvd.KVStore().set_gradient_compression("2bit")
    with pytest.raises(ValueError, match="created with compression=FP16Compressor; use one"):
        hvd.KVStore(compression=hvd.Compression.fp16).set_gradient_compression({"type": "2bit"})
    quantized = hvd.KVStore(prefix="kvbad.int.")
    quantized.set_gradient_compression({"type": "2bit"})
    with pytest.raises(TypeError, match="gradient compression '2bit' needs float32 values on "
                                        "the CPU; value\\[0\\] of 'kvbad.int.kvstore.pushpull.0' "
                                        "is int32"):
        quantized.pushpull(0, mx.nd.ones((3,), dtype="int32"))
    with pytest.raises(ValueError, match="update_on_kvstore=False"):  # MXNet's own check
        trainer = gluon.Trainer(params, "sgd", kvstore=store, update_on_kvstore=True)
        trainer._init_kvstore()
    out = hvd.allreduce(mx.nd.ones((3,)), op=hvd.Sum, name="after.kvbad")
    assert out.asnumpy().tolist() == [hvd.size()] * 3


def two_bit_inputs(rank, step, n=40):
    """Values on both sides of +-0.5 and exactly on it (k / 8 for k in -6..6),
    rank-, step- and index-dependent without a period."""
    return ((mixed(rank, n, salt=step, modulus=13) - 6) / 8).astype(np.float32)


@pytest.mark.parametrize("threshold", [0.5, 0.25])
def test_two_bit_compression_matches_mxnet_device_kvstore(threshold):
    # MXNet's own 2-bit kvstore, on one device per rank of this job, each
    # holding that rank's gradient: hvd.KVStore must give the same sums.
    rank, size = hvd.rank(), hvd.size()
    params = {"type": "2bit", "threshold": threshold}
    reference = mx.kv.create("device")
    reference.set_gradient_compression(params)
    reference.init(0, mx.nd.zeros((40,)))
    store = hvd.KVStore(prefix=f"kv2bit.{threshold}.")
    store.set_gradient_compression(params)
    for step in range(4):
        reference.push(0, [mx.nd.array(two_bit_inputs(r, step), ctx=mx.cpu(r))
                           for r in range(size)])
        expect = mx.nd.zeros((40,))
        reference.pull(0, out=expect)
        out = mx.nd.zeros((40,))
        store.pushpull(0, mx.nd.array(two_bit_inputs(rank, step)), out=out)
        got = out.asnumpy()
        assert got.tolist() == expect.asnumpy().tolist()
        assert set(np.unique(np.abs(got) / threshold)) - set(range(size + 1)) == set()
        assert all_equal_across_ranks(got)


def test_one_bit_through_the_kvstore_and_a_trainer():
    from test_compression import gradient, model_pack
    rank, size = hvd.rank(), hvd.size()
    store = hvd.KVStore(prefix="kv1bit.")
    store.set_gradient_compression({"type": "1bit"})
    residuals = [np.zeros(300, np.float32) for _ in range(size)]
    for step in range(2):
        value = mx.nd.array(gradient(rank, step, 300))
        store.pushpull("g", value)  # in place
        expect = np.zeros(300, np.float32)
        for r in range(size):
            sent, residuals[r] = model_pack(gradient(r, step, 300), residuals[r])
            expect += sent
        assert np.array_equal(value.asnumpy().view(np.uint32), expect.view(np.uint32))
    # A gluon.Trainer with MXNet's compression_params, as dist_sync scripts pass them.
    net = make_net("kv2bittrainer_", seed=0)
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": LR},
                            kvstore=hvd.KVStore(prefix="kv2bittrainer."),
                            compression_params={"type": "2bit", "threshold": 0.5})
    xs, ys = batches(2)
    for x, y in zip(xs, ys):
        with mx.autograd.record():
            loss = ((net(mx.nd.array(local(x))) - mx.nd.array(local(y))) ** 2).sum()
        loss.backward()
        trainer.step(B * size)
    for p in net.collect_params().values():
        assert all_equal_across_ranks(p.data().asnumpy())
