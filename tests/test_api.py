"""The public surface, before init: names exist, build flags answer, and
every collective refuses to run with a clear message; each submodule
imports on its own."""
import ast
import inspect
import os
import re

import mxnet as mx
import pytest

import hvdmx as hvd
from first_import import import_each_first

HOROVOD_MXNET_NAMES = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
    "cross_size", "cross_rank", "mpi_threads_supported", "mpi_built", "mpi_enabled",
    "nccl_built", "cuda_built", "gloo_built", "gloo_enabled", "ccl_built", "ddl_built",
    "rocm_built", "allreduce", "allreduce_",
    "grouped_allreduce", "grouped_allreduce_", "broadcast", "broadcast_", "Sum", "Average",
    "Min", "Max", "Product", "Adasum",
]


@pytest.mark.parametrize("name", HOROVOD_MXNET_NAMES)
def test_name_exists(name):
    assert hasattr(hvd, name)


# Parameters and defaults as horovod/mxnet (0.28.1) defines them, in order
# (read from its source; init is HorovodBasics.init). A script may pass any
# of them by position, so hvdmx must have the same order; what hvdmx adds
# (process_set on a few calls) comes after them.
HOROVOD_SIGNATURES = {
    "init": "comm=None, process_sets=None",
    "allreduce": "tensor, average=None, name=None, priority=0, prescale_factor=1.0, "
                 "postscale_factor=1.0, process_set=global_process_set, op=None",
    "allreduce_": "tensor, average=None, name=None, priority=0, prescale_factor=1.0, "
                  "postscale_factor=1.0, process_set=global_process_set, op=None",
    "grouped_allreduce": "tensors, average=None, name=None, priority=0, prescale_factor=1.0, "
                         "postscale_factor=1.0, process_set=global_process_set, op=None",
    "grouped_allreduce_": "tensors, average=None, name=None, priority=0, prescale_factor=1.0, "
                          "postscale_factor=1.0, process_set=global_process_set, op=None",
    "allgather": "tensor, name=None, priority=0, process_set=global_process_set",
    "grouped_allgather": "tensors, name=None, priority=0, process_set=global_process_set",
    "broadcast": "tensor, root_rank, name=None, priority=0, process_set=global_process_set",
    "broadcast_": "tensor, root_rank, name=None, priority=0, process_set=global_process_set",
    "alltoall": "tensor, splits=None, name=None, priority=0, process_set=global_process_set",
    "reducescatter": "tensor, op=Average, name=None, priority=0, "
                     "process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0",
    "grouped_reducescatter": "tensors, op=Average, name=None, priority=0, "
                             "process_set=global_process_set, prescale_factor=1.0, "
                             "postscale_factor=1.0",
    "DistributedOptimizer": "optimizer, gradient_predivide_factor=1.0, num_groups=0, "
                            "process_set=global_process_set",
    "DistributedTrainer": "params, optimizer, optimizer_params=None, "
                          "compression=Compression.none, gradient_predivide_factor=1.0, "
                          "prefix=None, num_groups=0, process_set=global_process_set",
    "broadcast_parameters": "params, root_rank=0, prefix=None",
    "broadcast_object": "obj, root_rank=0, name=None",
    "allgather_object": "obj, name=None",
}


@pytest.mark.parametrize("name", sorted(HOROVOD_SIGNATURES))
def test_parameters_are_horovods_in_order(name):
    ours = [p for p in inspect.signature(getattr(hvd, name)).parameters.values()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    theirs = [part.partition("=") for part in HOROVOD_SIGNATURES[name].split(", ")]
    assert [p.name for p in ours[:len(theirs)]] == [arg for arg, _, _ in theirs]
    for p, (arg, has_default, default) in zip(ours, theirs):
        if not has_default:
            assert p.default is p.empty, arg
        else:
            assert p.default == _default(default) and type(p.default) is \
                type(_default(default)), (arg, p.default)
    for extra in ours[len(theirs):]:
        assert extra.default is not extra.empty, f"{name}: {extra.name} needs a default"


def _default(text):
    """A default as written in Horovod's source: a literal, or a name
    (Average, global_process_set, Compression.none) looked up in hvdmx."""
    try:
        return ast.literal_eval(text)
    except ValueError:
        value = hvd
        for part in text.split("."):
            value = getattr(value, part)
        return value


def public_callables():
    """(label, function) for every public function of hvdmx and every public
    method its public classes define themselves."""
    for name in hvd.__all__:
        value = getattr(hvd, name)
        if inspect.isclass(value):
            for attr, member in vars(value).items():
                member = member.__func__ if isinstance(member, (staticmethod, classmethod)) \
                    else member
                if inspect.isfunction(member) and (attr == "__init__" or not attr.startswith("_")):
                    yield f"{name}.{attr}", member
        elif inspect.isfunction(value):
            yield name, value


def test_the_public_api_has_type_hints():
    # PEP 561 (hvdmx/py.typed): type checkers read these.
    missing = []
    for label, fn in public_callables():
        sig = inspect.signature(fn)
        for p in sig.parameters.values():
            if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty:
                missing.append(f"{label}({p.name})")
        if sig.return_annotation is inspect.Signature.empty:
            missing.append(f"{label} -> ?")
    assert not missing, missing
    assert os.path.isfile(os.path.join(os.path.dirname(hvd.__file__), "py.typed"))


def test_op_values_are_horovods():
    assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == (0, 1, 2, 3, 4, 5)


def test_the_core_lists_the_dtypes_the_docs_list():
    # The core's list (_core.ARRAY_DTYPES) is the one the ops and the tests
    # use; docs/collectives.md and the dtype error name the same, in one order.
    docs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
    with open(os.path.join(docs, "collectives.md")) as f:
        listed = re.search(r"Every dtype hvdmx supports \(([^)]*)\)", f.read()).group(1)
    assert sorted(listed.split(", ")) == sorted(hvd._core.ARRAY_DTYPES)
    assert hvd.ops._SUPPORTED_NAMES == listed
    assert set(hvd._core.ARRAY_DTYPES) < set(hvd._core.DTYPE_CODES)
    assert sorted(hvd._core.REDUCE_OPS.values()) == [hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min,
                                                     hvd.Max, hvd.Product]


def test_built_flags_work_before_init():
    assert not hvd.is_initialized()
    assert hvd.mpi_built() is True
    assert hvd.nccl_built() == 0
    assert hvd.cuda_built() is False
    assert hvd.gloo_built() is False
    assert hvd.ccl_built() is False
    assert hvd.gloo_enabled() is False
    assert hvd.ddl_built() is False
    assert hvd.rocm_built() is False


@pytest.mark.parametrize("call", [
    hvd.size, hvd.rank, hvd.local_rank, hvd.local_size, hvd.cross_rank, hvd.cross_size,
    hvd.mpi_threads_supported,
    lambda: hvd.allreduce(mx.nd.ones((1,))),
    lambda: hvd.allreduce_(mx.nd.ones((1,))),
    lambda: hvd.grouped_allreduce([mx.nd.ones((1,))]),
    lambda: hvd.broadcast(mx.nd.ones((1,)), 0),
    lambda: hvd.broadcast_(mx.nd.ones((1,)), 0),
    lambda: hvd.add_process_set([0]),
    lambda: hvd.start_timeline("never-written.json"),
    lambda: hvd.global_process_set.ranks,
    lambda: hvd.ProcessSet([0]).included(),
    lambda: hvd.ProcessSet([0]).rank(),
])
def test_calls_before_init_raise(call):
    with pytest.raises(ValueError, match="not been initialized, or has been shut down; call "
                                         "hvd.init\\(\\) first"):
        call()


@pytest.mark.parametrize("caught_as", [(mx.base.MXNetError, RuntimeError),
                                       (mx.base.MXNetError, ValueError)])
def test_a_collective_before_init_is_caught_as_horovod_callers_catch_it(caught_as):
    # Horovod's core reports it, so MXNet raises MXNetError there.
    try:
        hvd.allreduce(mx.nd.ones((1,)))
    except caught_as as error:
        assert isinstance(error, hvd.errors.NotRunningError)
    else:
        raise AssertionError("no error")


FIRST_IMPORTS = ["ops", "optimizer", "trainer", "functions", "objects", "process_sets",
                 "basics", "kvstore", "checkpoint", "compression"]


@pytest.fixture(scope="module")
def imported_first(tmp_path_factory):
    # Each in a child whose first hvdmx import is this submodule
    # (tests/first_import.py), then hvdmx initialized, its kvstore made, and
    # hvdmx shut down.
    then = ("import hvdmx as hvd, mxnet as mx\n"
            "hvd.init()\n"
            "assert mx.kv.create('dist_sync_hvdmx').type == 'dist_sync_hvdmx'\n"
            "hvd.shutdown()\n")
    return import_each_first([f"hvdmx.{m}" for m in FIRST_IMPORTS],
                             tmp_path_factory.mktemp("imports"), then)


@pytest.mark.parametrize("module", FIRST_IMPORTS)
def test_each_submodule_imports_first_on_its_own(module, imported_first):
    # The modules import each other, and none may find another half-initialized.
    code, output = imported_first[f"hvdmx.{module}"]
    assert code == 0, output
