"""Bad input for allgather, alltoall and reducescatter: local misuse raises
at the call; a cross-rank mismatch raises on every rank, at the call for
allgather and alltoall (their sizes round finds it) and at the read for
reducescatter, and the next collective still works."""
import mxnet as mx
import numpy as np
import pytest

import hvdmx as hvd
from hvdmx.errors import MismatchError


def still_works():
    out = hvd.allgather(mx.nd.ones((1, 2)))
    assert out.shape == (hvd.size(), 2)


def raises_at_read(out, match):
    with pytest.raises(mx.base.MXNetError, match=match):
        out.wait_to_read()
    still_works()


def raises_at_call(call, match):
    """``call()`` raises MismatchError on this rank (every rank runs this),
    caught as Horovod's callers catch it; then the job goes on."""
    with pytest.raises(MismatchError, match=match) as caught:
        call()
    assert isinstance(caught.value, mx.base.MXNetError)
    assert isinstance(caught.value, RuntimeError) and isinstance(caught.value, ValueError)
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
    raises_at_call(lambda: hvd.allgather(mx.nd.ones((2, 1 + (r == 1))), name="bad.ag.trailing"),
                   "allgather of tensor 'bad.ag.trailing' was called with different shape "
                   "after the first dimension.*rank 1 has \\(\\*, 2\\)")


def test_allgather_ndim_differs():
    needs_two()
    shape = (2, 3) if hvd.rank() == 0 else (2, 3, 1)
    raises_at_call(lambda: hvd.allgather(mx.nd.ones(shape), name="bad.ag.ndim"),
                   "different shape after the first dimension")


@pytest.mark.parametrize("kind", ["allgather", "alltoall", "reducescatter"])
def test_dtypes_differ(kind):
    needs_two()
    n = hvd.size()
    dtype = "float32" if hvd.rank() == 0 else "int32"
    x = mx.nd.ones((n, 2), dtype=dtype)
    name = f"bad.dtype.{kind}"
    match = f"{kind} of tensor '{name}' was called with different dtype.*rank 0 has float32, " \
            "rank 1 has int32"
    if kind == "reducescatter":  # no sizes round: the error comes with the data, at the read
        raises_at_read(hvd.reducescatter(x, name=name), match)
    else:
        raises_at_call(lambda: getattr(hvd, kind)(x, name=name), match)


def test_reducescatter_shapes_differ():
    needs_two()
    out = hvd.reducescatter(mx.nd.ones((hvd.size() + hvd.rank(), 2)), name="bad.rs.shape")
    raises_at_read(out, "reducescatter of tensor 'bad.rs.shape' was called with different "
                        "shape")


def test_grouped_allgather_and_alltoall_mismatches_raise_at_the_call():
    needs_two()
    r, n = hvd.rank(), hvd.size()
    group = [mx.nd.ones((1, 2))] * (1 + (r == 1))
    raises_at_call(lambda: hvd.grouped_allgather(group, name="bad.gag.count"),
                   "allgather of tensor 'bad.gag.count' was called with different "
                   "number of tensors.*rank 0 has 1, rank 1 has 2")
    x = mx.nd.ones((n, 2 + (r == 1)))
    raises_at_call(lambda: hvd.alltoall(x, splits=[1] * n, name="bad.a2a.trailing"),
                   "alltoall of tensor 'bad.a2a.trailing' was called with different shape "
                   "after the first dimension")


def test_every_rank_raises_in_the_same_round():
    # A mismatch and then a matching call of the same name: no rank may have
    # gone on to the data exchange of the first call while another raised,
    # or the second call's sizes would meet the first call's data.
    needs_two()
    r, n = hvd.rank(), hvd.size()
    for step in range(3):
        bad = mx.nd.ones((1, 1 + (r == n - 1)))
        raises_at_call(lambda bad=bad: hvd.allgather(bad, name="same.round"),
                       "'same.round' was called with different shape after the first dimension")
        good = hvd.allgather(mx.nd.full((r + 1, 2), r + step), name="same.round").asnumpy()
        want = np.concatenate([np.full((q + 1, 2), q + step) for q in range(n)])
        assert np.array_equal(good, want)


def catches(call, *kinds):
    """Runs ``call`` inside each ``except`` clause that Horovod's callers
    write around collectives; each must catch its error."""
    for caught_as in [(mx.base.MXNetError, RuntimeError), (mx.base.MXNetError, ValueError)]:
        try:
            call()
        except caught_as as error:
            assert isinstance(error, kinds), type(error)
        else:
            raise AssertionError(f"{call} raised nothing")


def test_errors_are_caught_as_horovod_callers_catch_them():
    n = hvd.size()
    x = mx.nd.ones((n * 2, 3))
    errors = hvd.errors
    # argument errors Horovod reports from its core: bad splits, a splits
    # array that is not int32, a size that does not divide
    catches(lambda: hvd.alltoall(x, splits=[0] * (n + 1)), errors.InvalidArgumentError,
            ValueError)
    catches(lambda: hvd.alltoall(x, splits=[2] * (n - 1) + [1]), errors.InvalidArgumentError)
    catches(lambda: hvd.alltoall(x, splits=mx.nd.ones((n,))), errors.InvalidTypeError, TypeError)
    catches(lambda: hvd.allreduce(mx.nd.zeros((3,), dtype="bool")), errors.InvalidTypeError)
    catches(lambda: hvd.broadcast(mx.nd.ones((2,)), root_rank=n), errors.InvalidArgumentError)
    catches(lambda: hvd.reducescatter(mx.nd.ones((4,)), op=hvd.Max),
            errors.InvalidArgumentError)
    catches(lambda: hvd.allgather(mx.nd.array(np.array(1.0).reshape(()))),
            errors.InvalidArgumentError)
    if n > 1:
        catches(lambda: hvd.alltoall(mx.nd.ones((n + 1, 2))), errors.InvalidArgumentError)
        r = hvd.rank()
        catches(lambda: hvd.allgather(mx.nd.ones((1, 1 + (r == 1))), name="catch.mismatch"),
                errors.MismatchError)
    # the kvstore's own checks, and a process set this rank is not in
    kv = hvd.KVStore()
    catches(lambda: kv.pushpull("k", [mx.nd.ones((2,)), mx.nd.ones((3,))]),
            errors.InvalidArgumentError)
    first = hvd.add_process_set([0])
    try:
        if hvd.rank() != 0:
            catches(lambda: hvd.allreduce(mx.nd.ones((2,)), process_set=first),
                    errors.InvalidArgumentError)
    finally:
        hvd.remove_process_set(first)
    # Python type mistakes stay plain TypeError, as in Horovod
    with pytest.raises(TypeError) as plain:
        hvd.allreduce([1.0, 2.0])
    assert not isinstance(plain.value, mx.base.MXNetError)
