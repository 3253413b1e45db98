"""Training integration: DistributedTrainer, DistributedOptimizer,
broadcast_parameters and compression, checked against one process training
the same model on the whole batch.

Every rank computes the single-process reference itself (a plain
gluon.Trainer or Module with kvstore=None on the N*B batch), from the same
initial parameters and the same data, so no result is sent between ranks
except for the bitwise comparisons.
"""
import pickle
import warnings

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon
from mxnet.gluon import nn

import hvdmx as hvd
from conftest import all_equal_across_ranks, host_allgather
from helpers import mnist_example_accuracy

IN, HIDDEN, OUT = 6, 8, 3
B = 4  # samples per rank and step
LR, MOMENTUM = 0.1, 0.9


def make_net(prefix, dtype="float32", seed=None, deferred=False):
    """A two-layer MLP, initialized from ``seed`` (default: rank-dependent, so
    that a test that forgets to broadcast sees different parameters)."""
    net = nn.HybridSequential(prefix=prefix)
    with net.name_scope():
        net.add(nn.Dense(HIDDEN, in_units=0 if deferred else IN, activation="tanh",
                         dtype=dtype))
        net.add(nn.Dense(OUT, in_units=0 if deferred else HIDDEN, dtype=dtype))
    mx.random.seed(1000 + (hvd.rank() if seed is None else seed))
    net.initialize(mx.init.Uniform(0.5))
    return net


def batches(steps, dtype="float32"):
    """The whole job's data: per step, N*B samples; rank r uses rows r*B..(r+1)*B."""
    rng = np.random.RandomState(7)
    n = hvd.size() * B
    xs = rng.uniform(-1, 1, size=(steps, n, IN)).astype(dtype)
    ys = rng.uniform(-1, 1, size=(steps, n, OUT)).astype(dtype)
    return xs, ys


def local(a):
    r = hvd.rank()
    return a[r * B:(r + 1) * B]


def structured(net):
    """Parameters by structural key ('0.weight', ...), which match between
    nets with different prefixes."""
    return net._collect_params_with_prefix()


def copy_params(src, dst):
    for key, p in structured(src).items():
        structured(dst)[key].set_data(p.data().copy())


def train_step(net, trainer, x, y, batch_size, split=False):
    loss_fn = gluon.loss.L2Loss()
    with autograd.record():
        loss = loss_fn(net(mx.nd.array(x, dtype=x.dtype)), mx.nd.array(y, dtype=y.dtype))
    loss.backward()
    if split:
        trainer.allreduce_grads()
        trainer.update(batch_size)
    else:
        trainer.step(batch_size)


def params_numpy(net):
    return {k: p.data().asnumpy() for k, p in structured(net).items()}


def assert_identical_across_ranks(net):
    for key, value in params_numpy(net).items():
        assert all_equal_across_ranks(value), f"parameter {key} differs across ranks"


def assert_close(got, want, rtol):
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=rtol, atol=rtol * 1e-2,
                                   err_msg=f"parameter {key}")


def paired_trainers(prefix, dtype="float32", ctxs=None, trainer_kwargs=None,
                    optimizer_params=None):
    """A net with a DistributedTrainer (parameters broadcast from rank 0) and a
    same-valued reference net with a plain gluon.Trainer, kvstore=None."""
    optimizer_params = optimizer_params or {"learning_rate": LR, "momentum": MOMENTUM}
    net = make_net(prefix, dtype)
    if ctxs:
        net.collect_params().reset_ctx(ctxs)
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)
    ref = make_net("ref_" + prefix, dtype)
    copy_params(net, ref)  # waits for the broadcast
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", dict(optimizer_params),
                                     **(trainer_kwargs or {}))
    ref_trainer = gluon.Trainer(ref.collect_params(), "sgd", dict(optimizer_params),
                                kvstore=None)
    return net, trainer, ref, ref_trainer


def distributed_and_reference(steps, prefix="eq_", trainer_kwargs=None, split=False,
                              dtype="float32", optimizer_params=None):
    """Trains a net with DistributedTrainer (checking after every step that all
    ranks agree bitwise) and, on every rank, a reference with gluon.Trainer on
    the whole batch. Returns both nets' parameters and the trainer."""
    net, trainer, ref, ref_trainer = paired_trainers(prefix, dtype, None, trainer_kwargs,
                                                     optimizer_params)
    xs, ys = batches(steps, dtype)
    for step in range(steps):
        train_step(net, trainer, local(xs[step]), local(ys[step]), B, split=split)
        train_step(ref, ref_trainer, xs[step], ys[step], hvd.size() * B)
        assert_identical_across_ranks(net)
    return params_numpy(net), params_numpy(ref), trainer


def test_data_parallel_equivalence():
    got, want, trainer = distributed_and_reference(steps=20)
    assert_close(got, want, rtol=1e-5)
    assert trainer._scale == pytest.approx(1.0 / hvd.size())
    assert trainer._kvstore is None


def test_steps_without_reads_in_between():
    """The usual loop: nothing is read between steps, so Python submits step
    k+1's allreduce of gradient i while step k's may still be queued in the
    engine (behind the backward pass that writes the same array)."""
    steps = 10
    net, trainer, ref, ref_trainer = paired_trainers("ahead_")
    xs, ys = batches(steps)
    for step in range(steps):
        train_step(net, trainer, local(xs[step]), local(ys[step]), B)
    for step in range(steps):
        train_step(ref, ref_trainer, xs[step], ys[step], hvd.size() * B)
    assert_identical_across_ranks(net)
    assert_close(params_numpy(net), params_numpy(ref), rtol=1e-5)


def test_allreduce_grads_then_update():
    got, want, _ = distributed_and_reference(steps=5, prefix="split_", split=True)
    assert_close(got, want, rtol=1e-5)


def test_two_contexts_per_rank():
    """Each rank splits its batch over two contexts; the trainer adds the two
    gradients before the allreduce (gluon.Trainer with kvstore=None would not)."""
    steps, ctxs = 5, [mx.cpu(0), mx.cpu(1)]
    net, trainer, ref, ref_trainer = paired_trainers("twoctxtrain_", ctxs=ctxs)
    xs, ys = batches(steps)
    loss_fn = gluon.loss.L2Loss()
    for step in range(steps):
        x, y = local(xs[step]), local(ys[step])
        with autograd.record():
            losses = [loss_fn(net(mx.nd.array(x[h::2], ctx=c)), mx.nd.array(y[h::2], ctx=c))
                      for h, c in enumerate(ctxs)]
        autograd.backward(losses)
        trainer.step(B)
        train_step(ref, ref_trainer, xs[step], ys[step], hvd.size() * B)
    for p in net.collect_params().values():
        first, second = (d.asnumpy() for d in p.list_data())
        assert np.array_equal(first, second), p.name
    assert_identical_across_ranks(net)
    assert_close(params_numpy(net), params_numpy(ref), rtol=1e-5)


@pytest.mark.parametrize("num_groups", [1, 2, 100])
def test_num_groups(num_groups):
    got, want, _ = distributed_and_reference(steps=5, prefix=f"groups{num_groups}_",
                                             trainer_kwargs={"num_groups": num_groups})
    assert_close(got, want, rtol=1e-5)


@pytest.mark.parametrize("factor", [0.5, 2.0])
def test_gradient_predivide_factor(factor):
    got, want, trainer = distributed_and_reference(
        steps=5, prefix="predivide_", trainer_kwargs={"gradient_predivide_factor": factor})
    assert_close(got, want, rtol=1e-5)
    assert trainer._scale == pytest.approx(factor / hvd.size())  # as Horovod


def test_fp16_compression_stays_close():
    kwargs = {"compression": hvd.Compression.fp16, "prefix": "fp16."}
    got, want, _ = distributed_and_reference(steps=10, prefix="fp16_", trainer_kwargs=kwargs)
    # Gradients rounded to float16 (11 bits) at every step: measured here about
    # 1e-3 of each parameter's norm after 10 steps, and 5e-5 elementwise.
    for key in want:
        error = np.linalg.norm(got[key] - want[key])
        assert error <= 1e-2 * np.linalg.norm(want[key]), key
        assert np.max(np.abs(got[key] - want[key])) < 1e-3, key
    # Integer tensors pass untouched, float tensors travel as float16 and back.
    ints = mx.nd.arange(5, dtype="int32")
    sent, ctx = hvd.Compression.fp16.compress(ints)
    assert sent is ints and hvd.Compression.fp16.decompress(sent, ctx) is ints
    floats = mx.nd.array([1.5, 2.25], dtype="float64")
    sent, ctx = hvd.Compression.fp16.compress(floats)
    assert sent.dtype == np.float16
    back = hvd.Compression.fp16.decompress(sent, ctx)
    assert back.dtype == np.float64 and back.asnumpy().tolist() == [1.5, 2.25]
    assert hvd.Compression.none.compress(floats) == (floats, None)


def test_multi_precision_float16_parameters():
    """float16 parameters with float32 master weights (multi_precision=True).
    MXNet's CPU build has no float16 FullyConnected, so the gradients are set
    by hand: rank r's is (r + 1) * g, whose average (n + 1) / 2 * g the
    reference trainer gets directly."""
    r, n = hvd.rank(), hvd.size()
    opt = {"learning_rate": 0.5, "momentum": MOMENTUM, "multi_precision": True}

    def params(tag):
        ps = [gluon.Parameter(f"{tag}_w", shape=(5,), dtype="float16"),
              gluon.Parameter(f"{tag}_v", shape=(3, 4), dtype="float16")]
        for p in ps:
            p.initialize(mx.init.Constant(0.5))
        return ps

    dist, ref = params("mp"), params("mpref")
    trainer = hvd.DistributedTrainer(dist, "sgd", dict(opt))
    ref_trainer = gluon.Trainer(ref, "sgd", dict(opt), kvstore=None)
    for step in range(4):
        for p, q in zip(dist, ref):
            g = (np.arange(p.data().size) % 4 + step).reshape(p.shape).astype(np.float16)
            p.grad()[:] = g * (r + 1)
            q.grad()[:] = g * (n + 1) / 2
            p.data()._fresh_grad = q.data()._fresh_grad = True  # as backward() would
        trainer.step(1)
        ref_trainer.step(1)
        for p in dist:
            assert all_equal_across_ranks(p.data().asnumpy())
    for p, q in zip(dist, ref):
        assert p.data().dtype == np.float16
        # The averaged gradients are exact (halves of small integers), so the
        # same float32 master-weight updates give the same float16 bits.
        assert np.array_equal(p.data().asnumpy(), q.data().asnumpy())
    master, _ = trainer._updaters[0].states[0]  # (float32 master weight, momentum)
    assert master.dtype == np.float32


def test_two_trainers_with_prefixes():
    """Two models trained side by side, their gradients in flight together:
    the same indices, told apart by the prefixes."""
    steps = 5
    nets, refs, trainers, ref_trainers = [], [], [], []
    for tag in ("a", "b"):
        net = make_net(f"two{tag}_")
        hvd.broadcast_parameters(net.collect_params(), root_rank=0, prefix=f"{tag}.")
        ref = make_net(f"tworef{tag}_")
        copy_params(net, ref)
        nets.append(net)
        refs.append(ref)
        trainers.append(hvd.DistributedTrainer(net.collect_params(), "sgd",
                                               {"learning_rate": LR, "momentum": MOMENTUM},
                                               prefix=f"{tag}."))
        ref_trainers.append(gluon.Trainer(ref.collect_params(), "sgd",
                                          {"learning_rate": LR, "momentum": MOMENTUM},
                                          kvstore=None))
    xs, ys = batches(steps)
    loss_fn = gluon.loss.L2Loss()
    for step in range(steps):
        with autograd.record():
            losses = [loss_fn(net(mx.nd.array(local(xs[step]))), mx.nd.array(local(ys[step])))
                      for net in nets]
        autograd.backward(losses)
        for trainer in trainers:
            trainer.allreduce_grads()  # both trainers' allreduces are queued
        for trainer in trainers:
            trainer.update(B)
        for ref, ref_trainer in zip(refs, ref_trainers):
            train_step(ref, ref_trainer, xs[step], ys[step], hvd.size() * B)
    for net, ref in zip(nets, refs):
        assert_identical_across_ranks(net)
        assert_close(params_numpy(net), params_numpy(ref), rtol=1e-5)


def test_save_and_load_states(tmp_path):
    """Resuming from saved parameters and trainer states (momentum) reproduces
    the uninterrupted run bitwise."""
    steps = 6
    xs, ys = batches(steps)
    opt = {"learning_rate": LR, "momentum": MOMENTUM}
    net = make_net("resume_")
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", dict(opt))
    params_file = str(tmp_path / f"params.{hvd.rank()}")
    states_file = str(tmp_path / f"states.{hvd.rank()}")
    for step in range(steps):
        if step == steps // 2:
            net.save_parameters(params_file)
            trainer.save_states(states_file)
        train_step(net, trainer, local(xs[step]), local(ys[step]), B)
    uninterrupted = params_numpy(net)

    resumed = make_net("resume_", seed=99)
    resumed.load_parameters(params_file)
    trainer2 = hvd.DistributedTrainer(resumed.collect_params(), "sgd", dict(opt))
    trainer2.load_states(states_file)
    assert trainer2._scale == trainer._scale
    for step in range(steps // 2, steps):
        train_step(resumed, trainer2, local(xs[step]), local(ys[step]), B)
    got = params_numpy(resumed)
    for key in uninterrupted:
        assert np.array_equal(got[key], uninterrupted[key]), key


def test_deferred_initialization():
    for root in range(hvd.size()):
        net = make_net(f"deferred{root}_", deferred=True)
        deferred = [p for p in net.collect_params().values() if p._deferred_init]
        assert len(deferred) == 2  # the weights; the biases' shapes are known
        hvd.broadcast_parameters(net.collect_params(), root_rank=root, prefix=f"d{root}.")
        assert all("_init_impl" in p.__dict__ for p in deferred)  # the hook waits
        net(mx.nd.ones((2, IN)))  # shapes known: initialized, then broadcast
        assert all("_init_impl" not in p.__dict__ for p in deferred)  # and removed
        assert_identical_across_ranks(net)
        # root_rank's values: what make_net draws with root's seed.
        want = make_net(f"deferredwant{root}_", deferred=True, seed=root)
        want(mx.nd.ones((2, IN)))
        for key, value in params_numpy(want).items():
            assert np.array_equal(params_numpy(net)[key], value), key


def test_deferred_initialization_then_trainer():
    net = make_net("deferredtrain_", deferred=True)
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": LR})
    xs, ys = batches(3)
    for step in range(3):
        train_step(net, trainer, local(xs[step]), local(ys[step]), B)
        assert_identical_across_ranks(net)


def test_broadcast_parameters_plain_dict_every_root():
    r = hvd.rank()
    for root in range(hvd.size()):
        params = {k: mx.nd.arange(k + 1, dtype="float32") * (r + 1) + 10 * k
                  for k in (3, 0, 11, 2)}
        params["bias"] = mx.nd.array([r, r], dtype="int64")
        hvd.broadcast_parameters(params, root_rank=root, prefix=f"plain{root}.")
        for k in (3, 0, 11, 2):
            want = np.arange(k + 1, dtype=np.float32) * (root + 1) + 10 * k
            assert np.array_equal(params[k].asnumpy(), want)
        assert params["bias"].asnumpy().tolist() == [root, root]


def test_broadcast_parameters_several_contexts():
    """A parameter on two contexts of one rank: every copy gets root's value."""
    ctxs = [mx.cpu(0), mx.cpu(1)]
    net = nn.Dense(3, in_units=2, prefix="twoctx_")
    mx.random.seed(hvd.rank())
    net.initialize(mx.init.Uniform(), ctx=ctxs)
    hvd.broadcast_parameters(net.collect_params(), root_rank=hvd.size() - 1)
    for p in net.collect_params().values():
        first, second = (d.asnumpy() for d in p.list_data())
        assert np.array_equal(first, second)
        assert all_equal_across_ranks(first)


def test_broadcast_parameters_onednn_layout():
    """Weights that an inference-mode forward left in oneDNN's layout."""
    net = nn.HybridSequential(prefix="onednn_")
    with net.name_scope():
        net.add(nn.Conv2D(4, kernel_size=3, in_channels=3), nn.BatchNorm(in_channels=4))
    mx.random.seed(hvd.rank() + 5)
    net.initialize(mx.init.Uniform())
    net.hybridize(static_alloc=True)
    net(mx.nd.ones((1, 3, 8, 8))).wait_to_read()  # inference mode
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)
    assert_identical_across_ranks(net)
    out = net(mx.nd.ones((1, 3, 8, 8))).asnumpy()
    assert all_equal_across_ranks(out)


def test_broadcast_parameters_bad_input():
    n = hvd.size()
    with pytest.raises(ValueError, match=f"'root_rank'={n} is out of range"):
        hvd.broadcast_parameters({0: mx.nd.ones(2)}, root_rank=n)
    with pytest.raises(ValueError, match="'root_rank'=-1"):
        hvd.broadcast_parameters({0: mx.nd.ones(2)}, root_rank=-1)
    with pytest.raises(TypeError, match="'params' must be a ParameterDict"):
        hvd.broadcast_parameters([mx.nd.ones(2)])
    with pytest.raises(TypeError, match=r"params\['x'\] must be a Parameter or an NDArray"):
        hvd.broadcast_parameters({"x": [1.0]})
    with pytest.raises(ValueError, match="'prefix' must be a str"):
        hvd.broadcast_parameters({0: mx.nd.ones(2)}, prefix=3)


# --- Module API --------------------------------------------------------------

def module_mlp():
    data = mx.sym.Variable("data")
    h = mx.sym.Activation(mx.sym.FullyConnected(data, num_hidden=HIDDEN, name="fc1"),
                          act_type="tanh")
    out = mx.sym.FullyConnected(h, num_hidden=OUT, name="fc2")
    return mx.sym.LinearRegressionOutput(out, mx.sym.Variable("label"), name="out")


def module(batch_size, arg_params, optimizer):
    mod = mx.mod.Module(module_mlp(), data_names=["data"], label_names=["label"])
    mod.bind(data_shapes=[("data", (batch_size, IN))],
             label_shapes=[("label", (batch_size, OUT))])
    mod.init_params(arg_params={k: v.copy() for k, v in arg_params.items()})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rescale_grad = 1/batch_size: Module stays quiet
        mod.init_optimizer(kvstore=None, optimizer=optimizer)
    return mod


@pytest.mark.parametrize("aggregate_num, num_groups", [(0, 0), (4, 0), (4, 2)])
def test_module_distributed_optimizer_equivalence(aggregate_num, num_groups):
    """aggregate_num 0: update() per index; 4: lists of indices."""
    steps = 8
    rng = np.random.RandomState(hvd.rank())
    arg_params = {"fc1_weight": rng.uniform(-0.5, 0.5, (HIDDEN, IN)),
                  "fc1_bias": rng.uniform(-0.5, 0.5, (HIDDEN,)),
                  "fc2_weight": rng.uniform(-0.5, 0.5, (OUT, HIDDEN)),
                  "fc2_bias": rng.uniform(-0.5, 0.5, (OUT,))}
    arg_params = {k: mx.nd.array(v) for k, v in arg_params.items()}
    hvd.broadcast_parameters(arg_params, root_rank=0, prefix="module.")

    def sgd(batch_size):
        opt = mx.optimizer.create("sgd", learning_rate=LR, momentum=MOMENTUM,
                                  rescale_grad=1.0 / batch_size)
        opt.aggregate_num = aggregate_num
        return opt

    dist_opt = hvd.DistributedOptimizer(sgd(B), num_groups=num_groups)
    mod = module(B, arg_params, dist_opt)
    ref = module(hvd.size() * B, arg_params, sgd(hvd.size() * B))
    assert dist_opt.idx2name  # Module's write reached the wrapped optimizer
    assert dist_opt._optimizer.idx2name == dist_opt.idx2name
    xs, ys = batches(steps)
    for step in range(steps):
        for m, x, y in ((mod, local(xs[step]), local(ys[step])), (ref, xs[step], ys[step])):
            m.forward_backward(mx.io.DataBatch([mx.nd.array(x)], [mx.nd.array(y)]))
            m.update()
        got = mod.get_params()[0]
        for value in got.values():
            assert all_equal_across_ranks(value.asnumpy())
    want = ref.get_params()[0]
    for key in want:
        np.testing.assert_allclose(got[key].asnumpy(), want[key].asnumpy(), rtol=1e-5,
                                   atol=1e-7, err_msg=key)


def test_distributed_optimizer_forwards_to_the_wrapped_one():
    inner = mx.optimizer.create("sgd", learning_rate=0.5, momentum=0.9, rescale_grad=0.25)
    opt = hvd.DistributedOptimizer(inner)
    assert isinstance(opt, mx.optimizer.Optimizer)
    assert opt.rescale_grad == 0.25 and opt.momentum == 0.9 and opt.learning_rate == 0.5
    opt.rescale_grad = 0.125
    opt.idx2name = {0: "w"}
    opt.set_learning_rate(0.05)
    opt.set_lr_mult({"w": 0.5})
    opt.set_wd_mult({"w": 0.0})
    assert inner.rescale_grad == 0.125 and inner.idx2name == {0: "w"}
    assert inner.lr == 0.05 and inner.lr_mult == {"w": 0.5} and inner.wd_mult["w"] == 0.0
    assert opt.aggregate_num == inner.aggregate_num
    state = opt.create_state_multi_precision(0, mx.nd.ones((3,)))
    assert state.shape == (3,)  # SGD's momentum
    copy = pickle.loads(pickle.dumps(opt))
    assert copy._optimizer.lr == 0.05 and copy.rescale_grad == 0.125
    with pytest.raises(TypeError, match="'optimizer' must be an mxnet.optimizer.Optimizer"):
        hvd.DistributedOptimizer("sgd")
    with pytest.raises(ValueError, match="'gradient_predivide_factor'=0"):
        hvd.DistributedOptimizer(inner, gradient_predivide_factor=0)
    with pytest.raises(ValueError, match="'num_groups'=-1"):
        hvd.DistributedOptimizer(inner, num_groups=-1)


@pytest.mark.parametrize("num_groups", [0, 1])
def test_distributed_optimizer_update_single_and_list(num_groups):
    """update (one index) and update_multi_precision (a list; float16 weights
    with float32 masters) average the ranks' gradients in place, then update."""
    r, n = hvd.rank(), hvd.size()
    inner = mx.optimizer.create("sgd", learning_rate=1.0, multi_precision=True)
    opt = hvd.DistributedOptimizer(inner, gradient_predivide_factor=2.0, num_groups=num_groups)
    weights = [mx.nd.zeros((5,)), mx.nd.zeros((3,), dtype="float16"),
               mx.nd.zeros((4,), dtype="float16")]
    grads = [mx.nd.arange(w.size, dtype=w.dtype) + 2 * r for w in weights]
    states = [opt.create_state_multi_precision(i, w) for i, w in enumerate(weights)]
    opt.update(10, weights[0], grads[0], states[0])
    opt.update_multi_precision([11, 12], weights[1:], grads[1:], states[1:])
    for w, g in zip(weights, grads):
        mean = np.arange(w.size) + (n - 1)  # the average over ranks of i + 2r
        # Small integers: exact in float16, whatever the number of ranks.
        np.testing.assert_array_equal(g.asnumpy(), mean)
        np.testing.assert_array_equal(w.asnumpy(), -mean)


# --- bad input ---------------------------------------------------------------

def test_parameters_differ_across_ranks():
    """A shape that differs on the last rank: every rank raises a
    MismatchError (a ValueError) naming the parameter, and nothing hangs."""
    if hvd.size() == 1:
        pytest.skip("needs two ranks")
    last = hvd.rank() == hvd.size() - 1
    for case in ("shape", "count"):
        net = nn.HybridSequential(prefix=f"differ{case}_")
        with net.name_scope():
            net.add(nn.Dense(HIDDEN, in_units=IN))
            net.add(nn.Dense(OUT + (1 if last and case == "shape" else 0), in_units=HIDDEN))
            if last and case == "count":
                net.add(nn.Dense(OUT, in_units=OUT))
        net.initialize()
        trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": LR})
        with autograd.record():
            loss = net(mx.nd.ones((2, IN))).sum()
        loss.backward()
        want = (f"differ across ranks.*position 2.*'differ{case}_dense1_bias' shape \\(3,\\)"
                if case == "shape" else "differ across ranks.*position 4.*no parameter")
        # a MismatchError: caught by except ValueError and by Horovod's
        # except (MXNetError, RuntimeError) alike
        with pytest.raises(hvd.errors.MismatchError, match=want) as caught:
            trainer.step(2)
        assert isinstance(caught.value, ValueError) and isinstance(caught.value, RuntimeError)
    out = hvd.allreduce(mx.nd.ones((3,)), op=hvd.Sum, name="after.differ")
    assert out.asnumpy().tolist() == [hvd.size()] * 3


def test_parameter_names_differ_across_ranks_warns():
    if hvd.size() == 1:
        pytest.skip("needs two ranks")
    net = nn.Dense(OUT, in_units=IN, prefix=f"names{hvd.rank() % 2}_")
    net.initialize()
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": LR})
    with autograd.record():
        loss = net(mx.nd.ones((2, IN))).sum()
    loss.backward()
    with pytest.warns(UserWarning, match="Only the names differ"):
        trainer.step(2)


def test_distributed_optimizer_given_to_trainer_is_unwrapped():
    net = make_net("unwrap_")
    inner = mx.optimizer.create("sgd", learning_rate=LR)
    with pytest.warns(UserWarning, match="unwrapped"):
        trainer = hvd.DistributedTrainer(net.collect_params(), hvd.DistributedOptimizer(inner))
    assert trainer._optimizer is inner


def test_trainer_rejects_kvstore_and_bad_arguments():
    params = make_net("reject_").collect_params()
    for kv in ("device", "dist_sync", mx.kv.create("local")):
        with pytest.raises(ValueError, match="'kvstore'=.* is not supported.*kvstore=None"):
            hvd.DistributedTrainer(params, "sgd", kvstore=kv)
    hvd.DistributedTrainer(params, "sgd", kvstore=None)  # what it is anyway
    with pytest.raises(ValueError, match="update_on_kvstore=True is not supported"):
        hvd.DistributedTrainer(params, "sgd", update_on_kvstore=True)
    with pytest.raises(ValueError, match="compression=hvd.Compression.fp16"):
        hvd.DistributedTrainer(params, "sgd", compression_params={"type": "2bit"})
    with pytest.raises(TypeError, match="unexpected keyword arguments \\['bogus'\\]"):
        hvd.DistributedTrainer(params, "sgd", bogus=1)
    with pytest.raises(ValueError, match="'gradient_predivide_factor'=-1"):
        hvd.DistributedTrainer(params, "sgd", gradient_predivide_factor=-1)
    with pytest.raises(ValueError, match="'prefix' must be a str"):
        hvd.DistributedTrainer(params, "sgd", prefix=1)
    with pytest.raises(ValueError, match="'num_groups'=1.5"):
        hvd.DistributedTrainer(params, "sgd", num_groups=1.5)
    with pytest.raises(TypeError, match="'compression' must be"):
        hvd.DistributedTrainer(params, "sgd", compression="fp16")


def test_trainer_sorts_a_list_of_parameters():
    net = make_net("sorted_")
    listed = list(net.collect_params().values())[::-1]
    trainer = hvd.DistributedTrainer(listed, "sgd", {"learning_rate": LR})
    names = [p.name for p in trainer._params]
    assert names == sorted(names)


# --- the example -------------------------------------------------------------

def test_mnist_example_smoke():
    # The job's learning rate (--lr x ranks) stays 0.1, and the steps about as
    # many, at any number of ranks: each rank has 1/size of the data, and a
    # learning rate scaled with 8 ranks makes so short a run diverge.
    size = hvd.size()
    accuracy = mnist_example_accuracy(["--epochs", str(max(2, size)), "--lr", str(0.1 / size),
                                       "--log-interval", "1000"])
    assert 0.25 < accuracy <= 1.0  # chance is 0.1; the full run reaches 0.98


# --- local SGD ---------------------------------------------------------------

def _local_sgd_trainer(h, prefix):
    # One parameter w (4 values); loss sum(w * x) has gradient x, rank r's x
    # being 2r at step k (k+1): integers, so every update and average is exact.
    w = gluon.Parameter(f"{prefix}w", shape=(4,), init=mx.init.Constant(10.0))
    w.initialize()
    trainer = hvd.DistributedTrainer([w], "sgd", {"learning_rate": 1.0}, local_sgd_steps=h,
                                     prefix=prefix)
    return w, trainer


def _local_sgd_step(w, trainer, k):
    x = mx.nd.full((4,), 2 * hvd.rank() * (k + 1))
    with autograd.record():
        loss = (w.data() * x).sum()
    loss.backward()
    trainer.step(1)


@pytest.mark.parametrize("h", [1, 2, 3])
def test_local_sgd_averages_every_h_steps(h):
    rank, size = hvd.rank(), hvd.size()
    w, trainer = _local_sgd_trainer(h, f"lsgd{h}.")
    for k in range(2 * h):
        _local_sgd_step(w, trainer, k)
        value = w.data().asnumpy()
        if (k + 1) % h == 0:
            # The average over ranks of each rank's own updates since the
            # last average: 10 - sum_k (k+1) * mean_r(2r) = 10 - (size-1) * ...
            assert value.tolist() == [10.0 - (size - 1) * (k + 1) * (k + 2) / 2] * 4
            assert all_equal_across_ranks(value)
        else:
            # In between, each rank has moved by its own gradients only.
            last = (k + 1) // h * h  # steps done at the last average
            synced = 10.0 - (size - 1) * last * (last + 1) / 2
            own = sum(2 * rank * (j + 1) for j in range(last, k + 1))
            assert value.tolist() == [synced - own] * 4


def test_local_sgd_average_parameters_on_demand_and_bad_input():
    w, trainer = _local_sgd_trainer(4, "lsgd.demand.")
    _local_sgd_step(w, trainer, 0)
    trainer.average_parameters()
    assert w.data().asnumpy().tolist() == [10.0 - (hvd.size() - 1)] * 4
    assert all_equal_across_ranks(w.data().asnumpy())
    params = make_net("lsgd.bad.").collect_params()
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=f"'local_sgd_steps'={bad!r} must be an int >= 1"):
            hvd.DistributedTrainer(params, "sgd", local_sgd_steps=bad)
    with pytest.raises(ValueError, match="local_sgd_steps=2 sends no gradients, so "
                                         "'compression'"):
        hvd.DistributedTrainer(params, "sgd", local_sgd_steps=2,
                               compression=hvd.Compression.fp16)


@pytest.mark.parametrize("h", [2, 3])
def test_hierarchical_local_sgd(h):
    """Every step averages the gradients over the host's ranks, every h-th
    the parameters over all ranks: in between, the ranks of a host hold the
    same values (moved by their host's mean gradient), and hosts differ.
    tests/test_many_hosts.py runs this across test hosts."""
    size = hvd.size()
    host = host_allgather(hvd.rank())
    prefix = f"hlsgd{h}."
    w = gluon.Parameter(f"{prefix}w", shape=(4,), init=mx.init.Constant(10.0))
    w.initialize()
    trainer = hvd.DistributedTrainer([w], "sgd", {"learning_rate": 1.0}, local_sgd_steps=h,
                                     hierarchical_local_sgd=True, prefix=prefix)
    host_mean = sum(2 * r for r in host) / len(host)  # of the ranks' gradients / (k+1)
    for k in range(2 * h):
        _local_sgd_step(w, trainer, k)
        value = w.data().asnumpy()
        last = (k + 1) // h * h  # steps done at the last average over all ranks
        synced = 10.0 - (size - 1) * last * (last + 1) / 2
        if (k + 1) % h == 0:
            assert value.tolist() == [synced] * 4
            assert all_equal_across_ranks(value)
        else:
            moved = host_mean * sum(j + 1 for j in range(last, k + 1))
            assert value.tolist() == [synced - moved] * 4
            same = host_allgather(value)
            assert all(np.array_equal(same[0], v) for v in same)


@pytest.mark.parametrize("h", [2, 3])
def test_easgd_moves_the_ranks_and_the_center(h):
    """Every h-th step each rank moves beta/size toward the center and the
    center beta toward the ranks' mean (a float64 model of the same steps);
    the center is bitwise the same on every rank, the ranks' parameters are
    not, and average_parameters() gives every rank the center."""
    rank, size, beta = hvd.rank(), hvd.size(), 0.5
    prefix = f"easgd{h}."
    w = gluon.Parameter(f"{prefix}w", shape=(4,), init=mx.init.Constant(10.0))
    w.initialize()
    trainer = hvd.DistributedTrainer([w], "sgd", {"learning_rate": 1.0}, local_sgd_steps=h,
                                     easgd_beta=beta, prefix=prefix)
    xs, center = [10.0] * size, 10.0
    for k in range(3 * h):
        _local_sgd_step(w, trainer, k)
        xs = [x - 2 * r * (k + 1) for r, x in enumerate(xs)]
        if (k + 1) % h == 0:
            distances = [x - center for x in xs]
            xs = [x - beta / size * d for x, d in zip(xs, distances)]
            center += beta * sum(distances) / size
            got = trainer._center[0].asnumpy()
            np.testing.assert_allclose(got, [center] * 4, rtol=1e-6)
            assert all_equal_across_ranks(got)
        np.testing.assert_allclose(w.data().asnumpy(), [xs[rank]] * 4, rtol=1e-6)
    if size > 1:
        assert not all_equal_across_ranks(w.data().asnumpy())
    trainer.average_parameters()
    assert np.array_equal(w.data().asnumpy(), trainer._center[0].asnumpy())
    assert all_equal_across_ranks(w.data().asnumpy())


def test_easgd_bad_input():
    params = make_net("easgd.bad.").collect_params()
    for bad in (0, 1.5, -0.1, True, "0.9"):
        with pytest.raises(ValueError, match=f"'easgd_beta'={bad!r} must be a number in "
                                             r"\(0, 1\]"):
            hvd.DistributedTrainer(params, "sgd", local_sgd_steps=2, easgd_beta=bad)
    with pytest.raises(ValueError, match="easgd_beta needs local_sgd_steps > 1"):
        hvd.DistributedTrainer(params, "sgd", easgd_beta=0.9)


def test_hierarchical_local_sgd_bad_input():
    params = make_net("hlsgd.bad.").collect_params()
    with pytest.raises(ValueError, match="hierarchical_local_sgd=True needs local_sgd_steps > 1"):
        hvd.DistributedTrainer(params, "sgd", hierarchical_local_sgd=True)
    with pytest.raises(ValueError, match="'hierarchical_local_sgd'='yes' must be True or False"):
        hvd.DistributedTrainer(params, "sgd", local_sgd_steps=2, hierarchical_local_sgd="yes")
    with pytest.raises(ValueError, match="leave 'process_set' at its default"):
        hvd.DistributedTrainer(params, "sgd", local_sgd_steps=2, hierarchical_local_sgd=True,
                               process_set=hvd.ProcessSet([0]))


@pytest.mark.skipif(hvd.size() != 2, reason="the accuracy target is for 2 ranks")
@pytest.mark.parametrize("flags", [[], ["--easgd-beta", "0.9"]], ids=["average", "easgd"])
def test_mnist_example_with_local_sgd_reaches_the_accuracy(flags):
    accuracy = mnist_example_accuracy(["--local-sgd-steps", "4", "--log-interval", "1000"]
                                      + flags)
    assert accuracy >= 0.95  # its final check raises if the ranks' parameters differ
