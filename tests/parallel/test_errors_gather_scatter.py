"""Bad input for allgather, alltoall and reducescatter: local misuse raises
at the call; a cross-rank mismatch raises MXNetError at read on every rank,
and the next collective still works."""
import mxnet as mx
import numpy as np
import pytest

import hvdmx as hvd


def still_works():
    out = hvd.allgather(mx.nd.ones((1, 2)))
    assert out.shape == (hvd.size(), 2)


def raises_at_read(out, match):
    with pytest.raises(mx.base.MXNetError, match=match):
        out.wait_to_read()
    still_works()


def test_scalars_are_refused():
    for fn in (hvd.allgather, hvd.reducescatter, hvd.alltoall):
        with pytest.raises(ValueError, match="0-d \\(scalar\\).*reshape\\(\\(1,\\)\\)"):
            fn(mx.nd.array(np.array(1.0).reshape(())))
    with pytest.raises(ValueError, match="tensors\\[1\\]' is a 0-d"):
        hvd.grouped_allgather([mx.nd.ones((1,)), mx.nd.array(np.array(1.0).reshape(()))])


def test_alltoall_bad_splits():
    n = hvd.size()
    x = mx.nd.ones((n * 2, 3))
    with pytest.raises(TypeError, match="'splits' must hold integers, got 1.0"):
        hvd.alltoall(x, splits=[1.0] + [1] * (n - 1))
    with pytest.raises(TypeError, match="'splits' must hold integers \\(int32\\), got an "
                                        "NDArray of float32"):
        hvd.alltoall(x, splits=mx.nd.ones((n,)))
    with pytest.raises(ValueError, match=f"'splits' has {n + 1} entries but the process set "
                                         f"has {n} ranks"):
        hvd.alltoall(x, splits=[0] * (n + 1))
    with pytest.raises(ValueError, match=f"sums to {2 * n - 1}, but the tensor has {2 * n} rows"):
        hvd.alltoall(x, splits=[2] * (n - 1) + [1])
    with pytest.raises(ValueError, match="negative"):
        hvd.alltoall(x, splits=[-1] + [0] * (n - 2) + [2 * n + 1] if n > 1 else [-1])
    with pytest.raises(TypeError, match="'splits' must be a list of ints"):
        hvd.alltoall(x, splits="2")


def test_alltoall_equal_split_must_divide():
    n = hvd.size()
    if n == 1:
        pytest.skip("every first dimension divides by 1")
    with pytest.raises(ValueError, match=f"first dimension \\({n + 1}\\) does not divide "
                                         f"evenly among {n} ranks; pass 'splits'"):
        hvd.alltoall(mx.nd.ones((n + 1, 2)))


def test_reducescatter_bad_op():
    with pytest.raises(ValueError, match="'op'=.* is not supported; reducescatter takes "
                                         "hvd.Average or hvd.Sum"):
        hvd.reducescatter(mx.nd.ones((4,)), op=hvd.Max)


def needs_two():
    if hvd.size() == 1:
        pytest.skip("a mismatch needs two ranks")


def test_allgather_trailing_dims_differ():
    needs_two()
    r = hvd.rank()
    out = hvd.allgather(mx.nd.ones((2, 1 + (r == 1))), name="bad.ag.trailing")
    raises_at_read(out, "allgather of tensor 'bad.ag.trailing' was called with different "
                        "shape after the first dimension.*rank 1 has \\(\\*, 2\\)")


def test_allgather_ndim_differs():
    needs_two()
    shape = (2, 3) if hvd.rank() == 0 else (2, 3, 1)
    out = hvd.allgather(mx.nd.ones(shape), name="bad.ag.ndim")
    raises_at_read(out, "different shape after the first dimension")


@pytest.mark.parametrize("kind", ["allgather", "alltoall", "reducescatter"])
def test_dtypes_differ(kind):
    needs_two()
    n = hvd.size()
    dtype = "float32" if hvd.rank() == 0 else "int32"
    x = mx.nd.ones((n, 2), dtype=dtype)
    name = f"bad.dtype.{kind}"
    out = getattr(hvd, kind)(x, name=name)
    raises_at_read(out, f"{kind} of tensor '{name}' was called with different dtype.*"
                        "rank 0 has float32, rank 1 has int32")


def test_reducescatter_shapes_differ():
    needs_two()
    out = hvd.reducescatter(mx.nd.ones((hvd.size() + hvd.rank(), 2)), name="bad.rs.shape")
    raises_at_read(out, "reducescatter of tensor 'bad.rs.shape' was called with different "
                        "shape")
