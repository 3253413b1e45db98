"""hvd.elastic under mpiexec, where a reset is hvd.shutdown() then hvd.init()
over the same world (hvdmx/elastic/driver.py): commit and restore give back
parameters, optimizer states and values bitwise; sync gives every rank rank
0's; run() retries after a HorovodInternalError and ends bitwise where an
uninterrupted run ends; a user's exception is not retried; a host update
announced on one rank interrupts every rank at the same commit; a reset
drops the old job's host votes, and the ranks sync together when one
restored and another was interrupted (issue 60); the reset limit ends the
run with ResetLimitError."""
import mxnet as mx
import pytest
from mxnet import gluon

import hvdmx as hvd
from hvdmx import _core, _job
from hvdmx.elastic import driver as _elastic_driver
from conftest import all_equal_across_ranks, world_bcast
from test_training import B, assert_identical_across_ranks, batches, local, make_net, \
    params_numpy, train_step

STEPS = 8


def optimizer(kind):
    """SGD with momentum and a schedule that moves at update counts 3, 6
    ...; Adam, whose bias correction reads each parameter's update count."""
    if kind == "sgd":
        return "sgd", {"learning_rate": 0.1, "momentum": 0.9,
                       "lr_scheduler": mx.lr_scheduler.FactorScheduler(step=3, factor=0.5)}
    return "adam", {"learning_rate": 0.01}


def states_numpy(trainer):
    """{index: [arrays of its optimizer state]} of the first context."""
    out = {}
    for index, state in trainer._updaters[0].states.items():
        parts = state if isinstance(state, (tuple, list)) else [state]
        out[index] = [p.asnumpy() for p in parts if p is not None]
    return out


def optimizer_counts(trainer):
    opt = trainer._optimizer
    return opt.num_update, dict(opt._index_update_count), opt.learning_rate, opt.wd


def assert_same(got, want, what):
    assert sorted(got) == sorted(want), what
    for key in want:
        g, w = got[key], want[key]
        if isinstance(w, list):
            assert len(g) == len(w), (what, key)
            for a, b in zip(g, w):
                assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), (what, key)
        else:
            assert g.dtype == w.dtype and g.tobytes() == w.tobytes(), (what, key)


def distributed(prefix, kind, seed=0):
    """A net (the same on every rank: seed) and its DistributedTrainer."""
    net = make_net(prefix, seed=seed)
    name, opt = optimizer(kind)
    return net, hvd.DistributedTrainer(net.collect_params(), name, opt, prefix=prefix)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_commit_then_restore_gives_back_the_commit_bitwise(kind):
    xs, ys = batches(STEPS)
    net, trainer = distributed(f"elrt{kind}_", kind)
    state = hvd.elastic.GluonState(net, trainer, epoch=0, seen=[])
    for step in range(3):
        train_step(net, trainer, local(xs[step]), local(ys[step]), B)
    state.epoch, state.seen = 3, [0, 1, 2]
    state.commit()
    params, states, counts = params_numpy(net), states_numpy(trainer), optimizer_counts(trainer)
    # Three more steps, changed values (one of them in place), a new weight decay.
    for step in range(3, 6):
        train_step(net, trainer, local(xs[step]), local(ys[step]), B)
    after = params_numpy(net)
    state.epoch = 6
    state.seen.append(99)
    trainer._optimizer.wd = 0.5
    assert counts != optimizer_counts(trainer)
    for _ in range(2):  # a restore can be repeated
        state.restore()
        assert_same(params_numpy(net), params, "parameters")
        assert_same(states_numpy(trainer), states, "optimizer states")
        assert optimizer_counts(trainer) == counts
        assert state.epoch == 3 and state.seen == [0, 1, 2]
    # Training goes on from the commit exactly as it went the first time.
    for step in range(3, 6):
        train_step(net, trainer, local(xs[step]), local(ys[step]), B)
    assert_same(params_numpy(net), after, "parameters after the same steps again")


def test_restore_drops_optimizer_states_created_after_the_commit():
    xs, ys = batches(2)
    net, trainer = distributed("elnostate_", "adam")
    state = hvd.elastic.GluonState(net.collect_params(), trainer)  # no step yet: no states
    initial = params_numpy(net)
    train_step(net, trainer, local(xs[0]), local(ys[0]), B)
    once = params_numpy(net)
    assert trainer._updaters[0].states
    state.restore()
    assert not trainer._updaters[0].states and trainer._optimizer.num_update == 0
    assert_same(params_numpy(net), initial, "parameters")
    train_step(net, trainer, local(xs[0]), local(ys[0]), B)
    assert_same(params_numpy(net), once, "the first step again")


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_sync_gives_every_rank_rank_0s_state_bitwise(kind):
    r = hvd.rank()
    xs, ys = batches(4)
    # Each rank its own initial parameters (seed), its own device id (the
    # optimizer's update counts are kept by device id), and a local trainer.
    ctx = mx.cpu(r)
    net = make_net(f"elsync{kind}_")
    net.collect_params().reset_ctx(ctx)
    name, opt = optimizer(kind)
    trainer = gluon.Trainer(net.collect_params(), name, opt, kvstore=None)
    # Odd ranks never step (no optimizer states, as a worker that just
    # joined); the others step r + 1 times on their own data.
    for step in range(0 if r % 2 else r + 1):
        x = mx.nd.array(local(xs[step]), ctx=ctx)
        y = mx.nd.array(local(ys[step]), ctx=ctx)
        with mx.autograd.record():
            loss = gluon.loss.L2Loss()(net(x), y)
        loss.backward()
        trainer.step(B)
    state = hvd.elastic.GluonState(net, trainer, epoch=r, name=f"rank {r}")
    root = world_bcast((params_numpy(net), states_numpy(trainer), optimizer_counts(trainer)))
    state.sync()
    assert (state.epoch, state.name) == (0, "rank 0")
    assert_same(params_numpy(net), root[0], "parameters")
    assert_same(states_numpy(trainer), root[1], "optimizer states")
    assert optimizer_counts(trainer) == root[2]
    # What sync gave is also the commit.
    state.epoch = 7
    state.restore()
    assert state.epoch == 0
    # The same next step everywhere: every rank continues as rank 0 would.
    x, y = mx.nd.array(xs[3][:B], ctx=ctx), mx.nd.array(ys[3][:B], ctx=ctx)
    with mx.autograd.record():
        loss = gluon.loss.L2Loss()(net(x), y)
    loss.backward()
    trainer.step(B)
    assert_identical_across_ranks(net)
    for arrays in states_numpy(trainer).values():
        for a in arrays:
            assert all_equal_across_ranks(a)


FAIL_AT = 5  # steps done when the failure comes; the last commit was at 4


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_run_restores_resets_and_goes_on_after_an_internal_error(kind, monkeypatch):
    resumed = []
    monkeypatch.setattr(_elastic_driver, "resumed", lambda: resumed.append(hvd.size()))
    xs, ys = batches(STEPS)
    # The uninterrupted run, for reference.
    ref, ref_trainer = distributed(f"elref{kind}_", kind)
    for step in range(STEPS):
        train_step(ref, ref_trainer, local(xs[step]), local(ys[step]), B)
    net, trainer = distributed(f"elrun{kind}_", kind)
    state = hvd.elastic.GluonState(net, trainer, step=0)
    calls, resets, started = [], [], []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])

    @hvd.elastic.run
    def train(state, steps):
        calls.append(state.step)
        while state.step < steps:
            train_step(net, trainer, local(xs[state.step]), local(ys[state.step]), B)
            state.step += 1
            if state.step % 2 == 0:
                state.commit()
            if state.step == FAIL_AT and not started:
                started.append(_core.is_initialized())
                # As a collective that lost its peer: with the step's
                # allreduces maybe still pending.
                raise hvd.elastic.HorovodInternalError("a peer is gone (simulated)")
        return "done"

    assert train(state, STEPS) == "done"
    assert calls == [0, 4], "the second call starts from the last commit"
    assert resets == [hvd.size()] and resumed == [hvd.size()]
    assert hvd.is_initialized()
    assert_same(params_numpy(net), params_numpy(ref), "parameters vs the uninterrupted run")
    assert_same(states_numpy(trainer), states_numpy(ref_trainer), "optimizer states")
    assert optimizer_counts(trainer) == optimizer_counts(ref_trainer)
    assert_identical_across_ranks(net)


def test_an_mxnet_error_is_recoverable_only_when_the_peers_are_gone(monkeypatch):
    state = hvd.elastic.ObjectState(tries=0)
    real = _job.stop_status
    gone = [True]

    def stop_status():  # the core's answer after a lost peer, once
        if gone[0]:
            gone[0] = False
            return _core.STATUS_PEER_GONE, "a peer is gone (simulated)"
        return real()

    @hvd.elastic.run
    def train(state):
        state.tries += 1
        state.commit()
        if state.tries == 1:
            monkeypatch.setattr(_job, "stop_status", stop_status)
            raise mx.base.MXNetError("a collective failed")
        return state.tries

    assert train(state) == 2
    monkeypatch.setattr(_job, "stop_status", real)

    @hvd.elastic.run
    def fails(state):  # hvdmx runs: the error is the program's
        raise mx.base.MXNetError("a collective failed")

    with pytest.raises(mx.base.MXNetError, match="a collective failed"):
        fails(state)

    # A peer that broke the protocol: no reset, the job fails with
    # hvdmx.PeerProtocolError (the core's status decides), from MXNet's error.
    broke = (_core.STATUS_PEER_PROTOCOL, "hvdmx: rank 1 sent a bad count (simulated)")
    calls = []

    @hvd.elastic.run
    def lied_to(state):
        calls.append(1)
        monkeypatch.setattr(_job, "stop_status", lambda: broke)
        raise mx.base.MXNetError("a collective failed")

    with pytest.raises(hvd.PeerProtocolError, match=r"rank 1 sent a bad count") as info:
        lied_to(state)
    monkeypatch.setattr(_job, "stop_status", real)
    assert calls == [1] and isinstance(info.value.__cause__, mx.base.MXNetError)


def test_a_users_exception_propagates_and_is_not_retried():
    state = hvd.elastic.ObjectState(n=0)
    calls = []

    @hvd.elastic.run
    def train(state):
        calls.append(1)
        state.commit()
        raise ValueError("bad batch in the user's code")

    with pytest.raises(ValueError, match="bad batch in the user's code"):
        train(state)
    assert calls == [1]
    assert hvd.is_initialized()


class CountingState(hvd.elastic.ObjectState):
    def __init__(self, **kwargs):
        self.counts = {"sync": 0, "restore": 0, "reset": 0}
        super().__init__(**kwargs)

    def sync(self):
        self.counts["sync"] += 1
        super().sync()

    def restore(self):
        self.counts["restore"] += 1
        super().restore()

    def reset(self):
        self.counts["reset"] += 1


@pytest.mark.parametrize("skip_sync", [False, True])
@pytest.mark.parametrize("announcer", ["first", "last"])
def test_a_host_update_seen_by_one_rank_interrupts_every_rank_at_the_same_commit(
        skip_sync, announcer):
    announcing = hvd.rank() == (0 if announcer == "first" else hvd.size() - 1)
    state = CountingState(step=0)
    commits, announced, calls = [], [], []

    @hvd.elastic.run
    def train(state):
        calls.append(state.step)
        while state.step < 6:
            state.step += 1
            if state.step == 3 and announcing and not announced:
                announced.append(1)
                _elastic_driver._announce_hosts_update(skip_sync)
            commits.append(state.step)
            state.commit()
        return state.step

    assert train(state) == 6
    # Seen at the commit of step 3, interrupting every rank at the next
    # commit (the check is pipelined: State.commit); no restore: the second
    # call goes on from step 4.
    assert commits == [1, 2, 3, 4, 5, 6]
    assert calls == [0, 4]
    assert state.counts == {"sync": 1 if skip_sync else 2, "restore": 0, "reset": 1}
    assert _elastic_driver.hosts_updated() == (False, False)  # the reset took it in
    assert world_bcast(calls) == calls


def test_check_host_updates_raises_on_every_rank_in_the_same_call():
    state = hvd.elastic.ObjectState()
    state.check_host_updates()
    if hvd.rank() == hvd.size() - 1:
        _elastic_driver._announce_hosts_update(False)
    with pytest.raises(hvd.elastic.HostsUpdatedInterrupt) as raised:
        state.check_host_updates()
    assert raised.value.skip_sync is False
    _elastic_driver._announced = None
    state.check_host_updates()


def test_the_old_jobs_host_votes_are_not_read_after_a_reset():
    # Issue 60: the votes the last commit sent belong to the job that was
    # lost. Here they say "updated" (announced at the commit of step 2, then
    # a peer lost before the next commit); the reset takes the update in, so
    # the first commit of the new job must not interrupt again. (After a real
    # loss they may be an allreduce that failed, whose error the restore's
    # drain took out of MXNet: read, they held whatever the buffer held.)
    state = CountingState(step=0)
    calls, failed = [], []

    @hvd.elastic.run
    def train(state):
        calls.append(state.step)
        while state.step < 4:
            state.step += 1
            if state.step == 3 and not failed:
                failed.append(1)
                raise hvd.elastic.HorovodInternalError("a peer is gone (simulated)")
            if state.step == 2 and hvd.rank() == 0 and not failed:
                _elastic_driver._announce_hosts_update(False)
            state.commit()
        return state.step

    assert train(state) == 4
    assert calls == [0, 2], "one reset, from the commit of step 2"
    assert state.counts == {"sync": 2, "restore": 1, "reset": 1}


def test_the_ranks_sync_together_when_one_restores_and_another_was_interrupted():
    # Issue 60: at the same commit rank 0 reads the votes (a host update that
    # needs no sync) while the last rank loses its peer first. Rank 0 resets
    # without a restore and would skip the sync; the last rank restores and
    # syncs: every rank must sync, or rank 0 trains on while the last rank
    # waits in the sync's broadcasts.
    if hvd.size() == 1:
        pytest.skip("needs two ranks: one interrupted, one that lost its peer")
    last = hvd.rank() == hvd.size() - 1
    state = CountingState(step=0)
    calls, announced = [], []

    @hvd.elastic.run
    def train(state):
        calls.append(state.step)
        while state.step < 6:
            state.step += 1
            if state.step == 3 and hvd.rank() == 0 and not announced:
                announced.append(1)
                _elastic_driver._announce_hosts_update(True)
            if state.step == 4 and last and state.counts["reset"] == 0:
                raise hvd.elastic.HorovodInternalError("a peer is gone (simulated)")
            state.commit()  # rank 0: HostsUpdatedInterrupt(skip_sync=True) at step 4
        return state.step

    assert train(state) == 6
    # Rank 0 committed step 4 before the interrupt; the last rank restored
    # step 3; the sync gives every rank rank 0's.
    assert calls == [0, 4]
    assert state.counts == {"sync": 2, "restore": 1 if last else 0, "reset": 1}
    assert world_bcast(calls) == calls


def test_the_reset_limit_ends_the_run(monkeypatch):
    monkeypatch.setenv("HVDMX_ELASTIC_RESET_LIMIT", "2")
    state = CountingState(x=0)
    calls = []

    @hvd.elastic.run
    def train(state):
        calls.append(1)
        raise hvd.elastic.HorovodInternalError("lost a peer again (simulated)")

    with pytest.raises(hvd.elastic.ResetLimitError, match="has reset 2 time") as raised:
        train(state)
    assert isinstance(raised.value.__cause__, hvd.elastic.HorovodInternalError)
    assert "HVDMX_ELASTIC_RESET_LIMIT=2" in str(raised.value)
    assert len(calls) == 3 and state.counts["reset"] == 2
    monkeypatch.setenv("HVDMX_ELASTIC_RESET_LIMIT", "0")
    calls.clear()
    with pytest.raises(hvd.elastic.ResetLimitError, match="has reset 0 time"):
        train(state)
    assert len(calls) == 1
    assert hvd.is_initialized()


# --- what else a commit keeps: onebit's residuals, the EASGD center, Module --

def residuals_numpy(trainer):
    return {i: r.asnumpy() for i, r in trainer._residuals.items()}


def center_numpy(trainer):
    return {i: c.asnumpy() for i, c in enumerate(trainer._center or [])}


def test_commit_then_restore_gives_back_this_ranks_onebit_residuals_bitwise():
    if hvd.size() == 1:
        pytest.skip("Compression.onebit exchanges nothing on one rank: no residuals")
    xs, ys = batches(6)
    net = make_net("elonebit_", seed=0)
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd",
                                     {"learning_rate": 0.1, "momentum": 0.9},
                                     compression=hvd.Compression.onebit, prefix="elonebit_")
    state = hvd.elastic.GluonState(net, trainer)  # no residuals yet
    train_step(net, trainer, local(xs[0]), local(ys[0]), B)
    assert trainer._residuals
    state.restore()
    assert trainer._residuals == {}, "residuals made after the commit are dropped"
    for step in range(2):
        train_step(net, trainer, local(xs[step]), local(ys[step]), B)
    state.commit()
    residuals, params = residuals_numpy(trainer), params_numpy(net)
    # Each rank's own: they differ between ranks (the test would not see a swap otherwise).
    assert not all(all_equal_across_ranks(r) for r in residuals.values())
    for step in range(2, 4):
        train_step(net, trainer, local(xs[step]), local(ys[step]), B)
    after, later = params_numpy(net), residuals_numpy(trainer)
    assert any(a.tobytes() != b.tobytes() for a, b in zip(later.values(), residuals.values()))
    state.restore()
    assert_same(residuals_numpy(trainer), residuals, "residuals")
    assert_same(params_numpy(net), params, "parameters")
    for step in range(2, 4):
        train_step(net, trainer, local(xs[step]), local(ys[step]), B)
    assert_same(params_numpy(net), after, "parameters after the same steps again")
    assert_same(residuals_numpy(trainer), later, "residuals after the same steps again")


def easgd(prefix):
    net = make_net(prefix)  # each rank its own initial parameters
    return net, hvd.DistributedTrainer(net.collect_params(), "sgd",
                                       {"learning_rate": 0.1, "momentum": 0.9},
                                       local_sgd_steps=2, easgd_beta=0.9, prefix=prefix)


def test_commit_restore_and_sync_give_back_the_easgd_center_bitwise():
    xs, ys = batches(8)
    net, trainer = easgd("eleasgd_")
    state = hvd.elastic.GluonState(net, trainer)  # before the center exists
    train_step(net, trainer, local(xs[0]), local(ys[0]), B)
    assert trainer._center is not None
    state.restore()
    assert trainer._center is None and trainer._local_steps_done == 0
    for step in range(3):  # the center moved at step 2; step 3 is a local one
        train_step(net, trainer, local(xs[step]), local(ys[step]), B)
    state.commit()
    center, params = center_numpy(trainer), params_numpy(net)
    assert all(all_equal_across_ranks(c) for c in center.values())
    for step in range(3, 6):
        train_step(net, trainer, local(xs[step]), local(ys[step]), B)
    after, later = params_numpy(net), center_numpy(trainer)
    assert any(a.tobytes() != b.tobytes() for a, b in zip(later.values(), center.values()))
    state.restore()
    assert_same(center_numpy(trainer), center, "center")
    assert_same(params_numpy(net), params, "parameters")
    assert trainer._local_steps_done == 3
    for step in range(3, 6):
        train_step(net, trainer, local(xs[step]), local(ys[step]), B)
    assert_same(params_numpy(net), after, "parameters after the same steps again")
    assert_same(center_numpy(trainer), later, "center after the same steps again")
    # A reset keeps it, and a rank without one (a worker that joins) gets rank 0's.
    state.on_reset()
    assert_same(center_numpy(trainer), later, "center after a reset")
    if hvd.rank() % 2:
        trainer._center, trainer._local_steps_done = None, 0
    state.sync()
    assert_same(center_numpy(trainer), later, "center after a sync")
    assert world_bcast(trainer._local_steps_done) == trainer._local_steps_done == 6
    assert_identical_across_ranks(net)


@pytest.mark.parametrize("kind", ["onebit", "easgd"])
def test_run_resumes_with_the_committed_residuals_and_center(kind, monkeypatch):
    monkeypatch.setattr(_elastic_driver, "resumed", lambda: None)
    xs, ys = batches(STEPS)
    if kind == "onebit":
        def build(prefix):
            net = make_net(prefix, seed=0)
            return net, hvd.DistributedTrainer(net.collect_params(), "sgd",
                                               {"learning_rate": 0.1, "momentum": 0.9},
                                               compression=hvd.Compression.onebit,
                                               prefix=prefix)
    else:
        build = easgd
    ref, ref_trainer = build(f"elrunref{kind}_")
    for step in range(STEPS):
        train_step(ref, ref_trainer, local(xs[step]), local(ys[step]), B)
    net, trainer = build(f"elrun{kind}_")
    state = hvd.elastic.GluonState(net, trainer, step=0)
    committed, resumed = {}, {}

    @hvd.elastic.run
    def train(state):
        if state.step:
            resumed.update(residuals=residuals_numpy(trainer), center=center_numpy(trainer),
                           local_steps=trainer._local_steps_done)
        while state.step < STEPS:
            train_step(net, trainer, local(xs[state.step]), local(ys[state.step]), B)
            state.step += 1
            if state.step == FAIL_AT - 2:
                state.commit()
                committed.update(residuals=residuals_numpy(trainer),
                                 center=center_numpy(trainer),
                                 local_steps=trainer._local_steps_done)
            if state.step == FAIL_AT and not resumed:
                raise hvd.elastic.HorovodInternalError("a peer is gone (simulated)")

    train(state)
    assert resumed["local_steps"] == committed["local_steps"] == \
        (FAIL_AT - 2 if kind == "easgd" else 0)
    assert_same(resumed["residuals"], committed["residuals"], "residuals at the resumption")
    assert_same(resumed["center"], committed["center"], "center at the resumption")
    if kind == "onebit":
        assert committed["residuals"] or hvd.size() == 1
        # Synchronous training: the interrupted run ends where the other ends.
        assert_same(params_numpy(net), params_numpy(ref), "parameters vs the uninterrupted run")
        assert_same(residuals_numpy(trainer), residuals_numpy(ref_trainer), "residuals")
        assert_identical_across_ranks(net)
    else:
        assert committed["center"]
        for c in center_numpy(trainer).values():
            assert all_equal_across_ranks(c)


def module_with_aux(seed, optimizer):
    """A bound Module with arg and aux params (BatchNorm's moving mean and
    variance), initialized from ``seed``, and its optimizer initialized."""
    data = mx.sym.Variable("data")
    h = mx.sym.FullyConnected(data, num_hidden=8, name="fc1")
    h = mx.sym.Activation(mx.sym.BatchNorm(h, name="bn", fix_gamma=False), act_type="tanh")
    out = mx.sym.FullyConnected(h, num_hidden=3, name="fc2")
    sym = mx.sym.LinearRegressionOutput(out, mx.sym.Variable("label"), name="out")
    mod = mx.mod.Module(sym, data_names=["data"], label_names=["label"])
    mod.bind(data_shapes=[("data", (B, 6))], label_shapes=[("label", (B, 3))])
    mx.random.seed(2000 + seed)
    mod.init_params(mx.init.Uniform(0.5))
    mod.init_optimizer(kvstore=None, optimizer=optimizer)
    return mod


def module_step(mod, x, y):
    mod.forward_backward(mx.io.DataBatch(data=[mx.nd.array(x)], label=[mx.nd.array(y)]))
    mod.update()


def module_numpy(mod):
    # A read of BatchNorm's moving mean and variance right after a step may
    # see the value before it (MXNet 1.9.1 on CPU): wait for the step first.
    mx.nd.waitall()
    arg, aux = mod.get_params()
    return {k: v.asnumpy() for k, v in {**arg, **aux}.items()}


def module_states(mod):
    out = {}
    for index, state in mod._updater.states.items():
        parts = state if isinstance(state, (tuple, list)) else [state]
        out[index] = [p.asnumpy() for p in parts if p is not None]
    return out


def sgd_for(batch):
    return mx.optimizer.create("sgd", learning_rate=0.1, momentum=0.9, rescale_grad=1.0 / batch,
                               lr_scheduler=mx.lr_scheduler.FactorScheduler(step=3, factor=0.5))


@pytest.mark.parametrize("compression", ["none", "onebit"])
def test_module_state_commit_then_restore_gives_back_the_commit_bitwise(compression):
    xs, ys = batches(6)
    xs, ys = xs[:, :, :6], ys[:, :, :3]
    opt = hvd.DistributedOptimizer(sgd_for(B), compression=getattr(hvd.Compression, compression))
    mod = module_with_aux(0, opt)
    state = hvd.elastic.ModuleState(mod, epoch=0)
    for step in range(2):
        module_step(mod, local(xs[step]), local(ys[step]))
    state.epoch = 2
    state.commit()
    params, states = module_numpy(mod), module_states(mod)
    counts = (opt.num_update, dict(opt._index_update_count), opt.learning_rate)
    residuals = {i: r.asnumpy() for i, r in opt._residuals.items()}
    assert bool(residuals) == (compression == "onebit" and hvd.size() > 1)
    assert any(k.startswith("bn_moving") for k in params)
    for step in range(2, 5):
        module_step(mod, local(xs[step]), local(ys[step]))
    after = module_numpy(mod)
    assert any(after[k].tobytes() != params[k].tobytes() for k in params if "moving" in k)
    state.epoch = 5
    state.restore()
    assert state.epoch == 2
    assert_same(module_numpy(mod), params, "arg and aux params")
    assert_same(module_states(mod), states, "optimizer states")
    assert (opt.num_update, dict(opt._index_update_count), opt.learning_rate) == counts
    assert_same({i: r.asnumpy() for i, r in opt._residuals.items()}, residuals, "residuals")
    for step in range(2, 5):
        module_step(mod, local(xs[step]), local(ys[step]))
    assert_same(module_numpy(mod), after, "parameters after the same steps again")
    for key in mod.get_params()[0]:  # the arg params (BatchNorm's statistics are each rank's)
        assert all_equal_across_ranks(after[key])


def test_module_state_sync_gives_every_rank_rank_0s_state_bitwise():
    r = hvd.rank()
    xs, ys = batches(4)
    xs, ys = xs[:, :, :6], ys[:, :, :3]
    # Each rank its own parameters and a local optimizer; odd ranks never step.
    mod = module_with_aux(r, sgd_for(B))
    for step in range(0 if r % 2 else r + 1):
        module_step(mod, local(xs[step]), local(ys[step]))
    state = hvd.elastic.ModuleState(mod, epoch=r)
    opt = mod._optimizer
    root = world_bcast((module_numpy(mod), module_states(mod), opt.num_update,
                        opt.learning_rate))
    state.sync()
    assert state.epoch == 0
    assert_same(module_numpy(mod), root[0], "arg and aux params")
    assert_same(module_states(mod), root[1], "optimizer states")
    assert (opt.num_update, opt.learning_rate) == root[2:]
    state.epoch = 3
    state.restore()  # what sync gave is also the commit
    assert state.epoch == 0
    assert_same(module_numpy(mod), root[0], "arg and aux params after a restore")
    module_step(mod, xs[3][:B], ys[3][:B])  # the same next step everywhere
    for value in module_numpy(mod).values():
        assert all_equal_across_ranks(value)
    assert all(all_equal_across_ranks(a) for s in module_states(mod).values() for a in s)


def test_module_state_bad_arguments_name_the_argument():
    with pytest.raises(TypeError, match="argument 'module' must be an mx.mod.Module"):
        hvd.elastic.ModuleState(make_net("elbadmod_"))
    mod = mx.mod.Module(mx.sym.Variable("data"), data_names=["data"], label_names=None)
    with pytest.raises(ValueError, match=r"argument 'module' is not ready .* call module.bind"):
        hvd.elastic.ModuleState(mod)


def test_module_state_under_run_ends_where_the_uninterrupted_run_ends(monkeypatch):
    monkeypatch.setattr(_elastic_driver, "resumed", lambda: None)
    xs, ys = batches(STEPS)

    def build():
        return module_with_aux(0, hvd.DistributedOptimizer(sgd_for(B),
                                                           compression=hvd.Compression.onebit))
    ref = build()
    for step in range(STEPS):
        module_step(ref, local(xs[step]), local(ys[step]))
    mod = build()
    state = hvd.elastic.ModuleState(mod, step=0)
    calls = []

    @hvd.elastic.run
    def train(state):
        calls.append(state.step)
        while state.step < STEPS:
            module_step(mod, local(xs[state.step]), local(ys[state.step]))
            state.step += 1
            if state.step % 2 == 0:
                state.commit()
            if state.step == FAIL_AT and len(calls) == 1:
                raise hvd.elastic.HorovodInternalError("a peer is gone (simulated)")

    train(state)
    assert calls == [0, 4]
    got, want = module_numpy(mod), module_numpy(ref)
    # BatchNorm's moving statistics are each rank's own in the uninterrupted
    # run; the sync after the reset gave every rank rank 0's, as it gives
    # every parameter. The arg params are the same on every rank anyway.
    compared = set(mod.get_params()[0]) if hvd.rank() else set(want)
    assert_same({k: got[k] for k in compared}, {k: want[k] for k in compared},
                "params vs the uninterrupted run")
    assert_same(module_states(mod), module_states(ref), "optimizer states")
    assert_same({i: r.asnumpy() for i, r in mod._optimizer._residuals.items()},
                {i: r.asnumpy() for i, r in ref._optimizer._residuals.items()}, "residuals")
