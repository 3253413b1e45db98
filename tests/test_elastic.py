"""hvd.elastic's parts that need no running job: the exceptions (Horovod's
names and classes, and where as_horovod puts them), the reset limit's
variable, ObjectState's copies, the layouts of optimizer states, and the
errors for bad arguments, each naming the argument, the value and the fix.
tests/parallel/test_elastic.py has the collective parts."""
import os
import subprocess
import sys
import textwrap

import mxnet as mx
import pytest
from mxnet.gluon import nn

import hvdmx as hvd
from hvdmx import elastic
from hvdmx.elastic import arrays as elastic_arrays
from hvdmx.errors import HorovodInternalError, HostsUpdatedInterrupt, ResetLimitError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_exceptions_have_horovods_names_and_classes():
    assert issubclass(HorovodInternalError, RuntimeError)
    assert issubclass(HostsUpdatedInterrupt, RuntimeError)
    assert not issubclass(HorovodInternalError, mx.base.MXNetError)
    interrupt = HostsUpdatedInterrupt(skip_sync=True)
    assert interrupt.skip_sync is True and HostsUpdatedInterrupt(False).skip_sync is False
    assert hvd.elastic.HorovodInternalError is HorovodInternalError
    assert hvd.elastic.HostsUpdatedInterrupt is HostsUpdatedInterrupt
    assert hvd.elastic.ResetLimitError is ResetLimitError


def test_as_horovod_has_them_where_horovod_does(tmp_path):
    script = tmp_path / "names.py"
    script.write_text(textwrap.dedent("""\
        from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
        from horovod.common.elastic import ObjectState, State
        import horovod.mxnet as hvd
        import horovod.mxnet.elastic
        import hvdmx
        assert HorovodInternalError is hvdmx.errors.HorovodInternalError
        assert HostsUpdatedInterrupt is hvdmx.errors.HostsUpdatedInterrupt
        assert State is hvdmx.elastic.State and ObjectState is hvdmx.elastic.ObjectState
        assert hvd.elastic.run is hvdmx.elastic.run
        assert horovod.mxnet.elastic.GluonState is hvdmx.elastic.GluonState
        print("ok")
        """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
        OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "hvdmx.as_horovod", str(script)],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.parametrize("environ, limit", [
    ({}, None),
    ({"HVDMX_ELASTIC_RESET_LIMIT": "0"}, 0),
    ({"HVDMX_ELASTIC_RESET_LIMIT": " 3 "}, 3),
    ({"HOROVOD_ELASTIC_RESET_LIMIT": "2"}, 2),
    ({"HVDMX_ELASTIC_RESET_LIMIT": "5", "HOROVOD_ELASTIC_RESET_LIMIT": "2"}, 5),
    ({"HVDMX_ELASTIC_RESET_LIMIT": ""}, None),
])
def test_reset_limit_from_the_environment(environ, limit):
    assert elastic.reset_limit(environ) == limit


@pytest.mark.parametrize("value", ["-1", "two", "1.5"])
def test_a_bad_reset_limit_names_the_variable_and_the_value(value):
    with pytest.raises(ValueError, match=rf"HVDMX_ELASTIC_RESET_LIMIT='{value}' must be an "
                                         r"int >= 0"):
        elastic.reset_limit({"HVDMX_ELASTIC_RESET_LIMIT": value})


def test_object_state_saves_and_restores_copies():
    state = hvd.elastic.ObjectState(epoch=1, seen=[1, 2])
    state.seen.append(3)  # changed in place, uncommitted
    state.epoch = 2
    state.restore()
    assert (state.epoch, state.seen) == (1, [1, 2])
    state.seen.append(4)
    state.save()
    state.seen.append(5)
    state.restore()
    state.restore()
    assert state.seen == [1, 2, 4]
    restored = state.seen
    restored.append(6)  # a restore hands out a copy, the commit stays
    state.restore()
    assert state.seen == [1, 2, 4]


def test_state_names_that_would_hide_the_api_are_refused():
    with pytest.raises(ValueError, match=r"attribute 'commit' would hide ObjectState.commit"):
        hvd.elastic.ObjectState(commit=1)
    with pytest.raises(ValueError, match=r"attribute '_x' starts with '_'"):
        hvd.elastic.ObjectState(_x=1)


def test_the_base_state_says_what_a_subclass_defines():
    state = hvd.elastic.State()
    for method in (state.save, state.restore, state.sync):
        with pytest.raises(NotImplementedError, match="a State subclass defines save, restore "
                                                      "and sync"):
            method()
    state.reset()  # nothing to do by default


def test_reset_callbacks_run_in_order_after_reset():
    calls = []

    class Mine(hvd.elastic.ObjectState):
        def reset(self):
            calls.append("reset")

    state = Mine(x=1)
    state.register_reset_callbacks([lambda: calls.append(1)])
    state.register_reset_callbacks((lambda: calls.append(2),))
    state.on_reset()
    assert calls == ["reset", 1, 2]


@pytest.mark.parametrize("callbacks, message", [
    (print, r"argument 'callbacks' must be a list of functions, got builtin_function_or_"
            r"method .*wrap a single function in a list"),
    ([print, 3], r"callbacks\[1\]=3 is not callable \(int\)"),
    ("f", r"argument 'callbacks' must be a list of functions, got str"),
])
def test_bad_reset_callbacks_are_named(callbacks, message):
    with pytest.raises(TypeError, match=message):
        hvd.elastic.ObjectState().register_reset_callbacks(callbacks)


def test_run_checks_its_arguments():
    with pytest.raises(TypeError, match=r"argument 'func'=3 must be a function"):
        hvd.elastic.run(3)

    @hvd.elastic.run
    def train(state):
        return state

    with pytest.raises(TypeError, match=r"the first argument of 'train' must be an "
                                        r"hvd.elastic.State .*got dict"):
        train({"epoch": 0})
    assert train.__name__ == "train"


def net_and_params():
    net = nn.Dense(2, in_units=3, prefix="elunit_")
    net.initialize()
    return net


@pytest.mark.parametrize("params, error, message", [
    (None, TypeError, r"argument 'params' must be a gluon Block \(the model\), a ParameterDict "
                      r"or a dict of Parameters, got NoneType \(None\); pass "
                      r"net.collect_params\(\)"),
    ([1, 2], TypeError, r"argument 'params' must be .* got list \(\[1, 2\]\)"),
    ({"w": mx.nd.zeros(2)}, TypeError, r"params\['w'\] must be a gluon Parameter, got NDArray"),
    ({1: None}, TypeError, r"the keys of argument 'params' must be str, got 1"),
    ({}, ValueError, r"argument 'params' holds no parameters"),
])
def test_gluon_state_names_bad_params(params, error, message):
    with pytest.raises(error, match=message):
        hvd.elastic.GluonState(params, None)


def test_gluon_state_names_a_bad_trainer():
    net = net_and_params()
    with pytest.raises(TypeError, match=r"argument 'trainer' must be a gluon.Trainer \(hvd."
                                        r"DistributedTrainer\) or None, got str \('sgd'\)"):
        hvd.elastic.GluonState(net, "sgd")
    other = nn.Dense(2, in_units=3, prefix="elother_")
    other.initialize()
    trainer = mx.gluon.Trainer(other.collect_params(), "sgd", kvstore=None)
    with pytest.raises(ValueError, match=r"the trainer's parameter 'elother_bias' is not "
                                         r"among argument 'params'"):
        hvd.elastic.GluonState(net, trainer)
    with pytest.raises(ValueError, match=r"attribute 'sync' would hide GluonState.sync"):
        hvd.elastic.GluonState(net, None, sync=1)


def test_layouts_of_optimizer_states():
    a, b = mx.nd.zeros((2, 3)), mx.nd.zeros(4, dtype="float16")
    layout = elastic_arrays._layout((a, [b, None]))
    assert layout == ("tuple", (("array", (2, 3), "float32"),
                                ("list", (("array", (4,), "float16"), ("value", None)))))
    assert elastic_arrays._count_arrays(layout) == 2
    assert elastic_arrays._arrays((a, [b, None])) == [a, b]
    built = elastic_arrays._build(layout, lambda shape, dtype: mx.nd.ones(shape, dtype=dtype))
    assert elastic_arrays._layout(built) == layout


def test_snapshot_copies_bitwise_and_allocates_once():
    arrays = [mx.nd.arange(6).reshape((2, 3)), mx.nd.array([1, 2], dtype="float16"),
              mx.nd.arange(3, dtype="int64")]
    snapshot = elastic_arrays._Snapshot()
    snapshot.take(arrays)
    buffers = list(snapshot._buffers)
    for i, a in enumerate(arrays):
        assert snapshot.copy_of(i).dtype == a.asnumpy().dtype
        assert snapshot.copy_of(i).tobytes() == a.asnumpy().tobytes()
    arrays[0][:] = 7
    snapshot.take(arrays)
    assert all(x is y for x, y in zip(snapshot._buffers, buffers))  # the same buffers
    assert (snapshot.copy_of(0) == 7).all()


def test_a_save_that_raises_leaves_the_last_commit_whole(monkeypatch):
    net = nn.Dense(3, in_units=4, prefix="elhalf_")
    net.initialize(mx.init.Uniform(0.5))
    trainer = mx.gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1,
                                                            "momentum": 0.9}, kvstore=None)
    x = mx.nd.array([[1, 2, 3, 4], [4, 3, 2, 1]])

    def step():
        with mx.autograd.record():
            loss = (net(x) ** 2).sum()
        loss.backward()
        trainer.step(2)

    step()
    state = hvd.elastic.GluonState(net, trainer, step=1)
    step()
    state.step = 2
    state.save()  # the commit to come back to
    committed = {k: p.data().asnumpy() for k, p in net.collect_params().items()}
    step()
    state.step = 3
    real = elastic_arrays._Snapshot.take

    def fails_half_way(self, arrays):  # as a copy that meets the failed step's error
        real(self, arrays[:1])
        raise mx.base.MXNetError("the step before failed (simulated)")

    monkeypatch.setattr(elastic_arrays._Snapshot, "take", fails_half_way)
    with pytest.raises(mx.base.MXNetError, match="simulated"):
        state.save()
    monkeypatch.setattr(elastic_arrays._Snapshot, "take", real)
    state.restore()
    assert state.step == 2
    for key, p in net.collect_params().items():
        assert p.data().asnumpy().tobytes() == committed[key].tobytes(), key
