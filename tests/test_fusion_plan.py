"""Which allreduce tensors of a round are fused together (csrc/hvdmx/runtime/fusion_plan.h)."""
from hypothesis import given, settings, strategies as st

import _hvdmx_testing

FLOAT32, FLOAT64 = 0, 1
SIZE = {FLOAT32: 4, FLOAT64: 8}


def plan(responses, threshold, max_tensor_bytes):
    return _hvdmx_testing.plan_fusion(responses, threshold, max_tensor_bytes)


def test_small_tensors_fuse_and_a_large_one_runs_alone():
    kib = 1024 // 4  # float32 elements per KiB
    responses = [(FLOAT32, [kib]), (FLOAT32, [kib]), (FLOAT32, [512 * kib]), (FLOAT32, [kib]),
                 (FLOAT32, [kib])]
    assert plan(responses, 64 << 20, 256 << 10) == [
        [(0, 0), (1, 0)], [(2, 0)], [(3, 0), (4, 0)]]
    # Without the limit the large tensor joins the group.
    assert plan(responses, 64 << 20, 1 << 30) == [[(0, 0), (1, 0), (2, 0), (3, 0), (4, 0)]]


def test_threshold_and_dtype_split_groups():
    responses = [(FLOAT32, [100, 100]), (FLOAT64, [10]), (FLOAT32, [100])]
    assert plan(responses, 800, 1 << 20) == [[(0, 0), (0, 1)], [(1, 0)], [(2, 0)]]
    assert plan(responses, 400, 1 << 20) == [[(0, 0)], [(0, 1)], [(1, 0)], [(2, 0)]]
    assert plan(responses, 0, 1 << 20) == [[(0, 0)], [(0, 1)], [(1, 0)], [(2, 0)]]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([FLOAT32, FLOAT64]),
                          st.lists(st.integers(0, 5000), min_size=1, max_size=4)),
                max_size=12),
       st.integers(0, 40000), st.integers(0, 40000))
def test_plan_properties(responses, threshold, max_tensor_bytes):
    groups = plan(responses, threshold, max_tensor_bytes)
    # Every tensor exactly once, in round order.
    flat = [item for group in groups for item in group]
    assert flat == [(r, t) for r, (_, counts) in enumerate(responses) for t in range(len(counts))]

    def nbytes(item):
        dtype, counts = responses[item[0]]
        return counts[item[1]] * SIZE[dtype]

    for group in groups:
        if len(group) > 1:
            assert sum(nbytes(i) for i in group) <= threshold
            assert all(nbytes(i) <= max_tensor_bytes for i in group)
            assert len({responses[r][0] for r, _ in group}) == 1
    # Greedy: a group is closed only when the next tensor could not join it.
    for group, following in zip(groups, groups[1:]):
        nxt = following[0]
        joinable = (responses[group[0][0]][0] == responses[nxt[0]][0]
                    and all(nbytes(i) <= max_tensor_bytes for i in group)
                    and nbytes(nxt) <= max_tensor_bytes
                    and sum(nbytes(i) for i in group) + nbytes(nxt) <= threshold)
        assert not joinable
