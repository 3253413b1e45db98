"""The public surface, before init: names exist, build flags answer, and
every collective refuses to run with a clear message; each submodule
imports on its own."""
import subprocess
import sys

import mxnet as mx
import pytest

import hvdmx as hvd

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


def test_op_values_are_horovods():
    assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == (0, 1, 2, 3, 4, 5)


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
])
def test_calls_before_init_raise(call):
    with pytest.raises(ValueError, match="not been initialized, or has been shut down; call hvd.init\\(\\) first"):
        call()


@pytest.mark.parametrize("module", ["ops", "optimizer", "functions", "process_sets", "basics",
                                    "kvstore", "checkpoint", "compression"])
def test_each_submodule_imports_first_on_its_own(module):
    # A fresh interpreter whose first hvdmx import is this submodule: the
    # modules import each other, and none may find another half-initialized.
    code = (f"import hvdmx.{module}\n"
            "import hvdmx as hvd, mxnet as mx\n"
            "hvd.init()\n"
            "assert mx.kv.create('dist_sync_hvdmx').type == 'dist_sync_hvdmx'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
