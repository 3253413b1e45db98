"""The environment reader: defaults, HOROVOD_* twins, and clear errors."""
import pytest

import _hvdmx_testing


def test_defaults():
    c = _hvdmx_testing.load_config({})
    assert c["fusion_threshold"] == 64 * 1024 * 1024
    assert c["fusion_max_tensor_bytes"] == 256 * 1024
    assert c["fusion_piece_bytes"] == 1024 * 1024
    assert c["output_pool_bytes"] == 256 * 1024 * 1024
    assert c["cycle_time_ms"] == 0
    assert c["cache_capacity"] == 1024
    assert c["allreduce_algo"] == "auto"
    assert c["stall_check_seconds"] == 60
    assert c["stall_shutdown_seconds"] == 0


def test_hvdmx_names_and_horovod_twins():
    c = _hvdmx_testing.load_config({"HOROVOD_FUSION_THRESHOLD": "1024",
                                    "HOROVOD_CYCLE_TIME": "2.5",
                                    "HOROVOD_CACHE_CAPACITY": "0"})
    assert (c["fusion_threshold"], c["cycle_time_ms"], c["cache_capacity"]) == (1024, 2.5, 0)
    # the HVDMX_ name wins over its twin
    c = _hvdmx_testing.load_config({"HOROVOD_FUSION_THRESHOLD": "1024",
                                    "HVDMX_FUSION_THRESHOLD": "2048"})
    assert c["fusion_threshold"] == 2048
    c = _hvdmx_testing.load_config({"HVDMX_ALLREDUCE_ALGO": "ring",
                                    "HVDMX_RING_SEGMENT_BYTES": "4096",
                                    "HVDMX_LOG_LEVEL": "DEBUG"})
    assert (c["allreduce_algo"], c["ring_segment_bytes"], c["log_level"]) == ("ring", 4096, 1)
    c = _hvdmx_testing.load_config({"HOROVOD_FUSION_MAX_TENSOR_BYTES": "1048576"})
    assert c["fusion_max_tensor_bytes"] == 1 << 20
    c = _hvdmx_testing.load_config({"HOROVOD_FUSION_PIECE_BYTES": "65536"})
    assert c["fusion_piece_bytes"] == 65536
    c = _hvdmx_testing.load_config({"HOROVOD_OUTPUT_POOL_BYTES": "0"})
    assert c["output_pool_bytes"] == 0
    c = _hvdmx_testing.load_config({"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "2.5"})
    assert c["stall_shutdown_seconds"] == 2.5


@pytest.mark.parametrize("name,value,accepted", [
    ("HVDMX_FUSION_THRESHOLD", "64MB", "a byte count"),
    ("HVDMX_FUSION_THRESHOLD", "-1", "a byte count"),
    ("HVDMX_FUSION_MAX_TENSOR_BYTES", "1M", "a byte count >= 0"),
    ("HVDMX_FUSION_PIECE_BYTES", "32", "a byte count >= 64"),
    ("HVDMX_OUTPUT_POOL_BYTES", "-1", "a byte count >= 0 (0 keeps no output memory)"),
    ("HOROVOD_CYCLE_TIME", "fast", "milliseconds"),
    ("HVDMX_CACHE_CAPACITY", "1.5", "an integer"),
    ("HVDMX_ALLREDUCE_ALGO", "tree", "one of auto, ring, mpi"),
    ("HVDMX_RING_SEGMENT_BYTES", "8", "a byte count >= 64"),
    ("HVDMX_LOG_LEVEL", "loud", "one of trace"),
    ("HVDMX_STALL_CHECK_TIME_SECONDS", "inf", "seconds"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "-2", "seconds >= 0"),
    ("HVDMX_HUGE_PAGES", "yes", "1 or 0"),
    ("HVDMX_SHM_PUSH", "on", "1 or 0"),
    ("HVDMX_ADASUM_HIERARCHICAL", "yes", "1 or 0"),
    ("HVDMX_HALF_PARTIALS", "float16", "float32 (exact: partial sums in float32, rounded once) "
     "or half"),
    ("HVDMX_CPU_BIND", "socket", "one of auto, core, none"),
])
def test_bad_values_name_the_variable_the_value_and_the_fix(name, value, accepted):
    with pytest.raises(ValueError) as info:
        _hvdmx_testing.load_config({name: value})
    message = str(info.value)
    assert f"{name}='{value}'" in message
    assert accepted in message
    assert "Fix or unset it" in message


def test_shared_memory_and_hierarchical_variables():
    c = _hvdmx_testing.load_config({})
    assert (c["shm_min_bytes"], c["shm_chunk_bytes"]) == (0, 256 * 1024)
    assert c["hierarchical_allreduce"] is False and c["testing_ranks_per_host"] == 0
    c = _hvdmx_testing.load_config({"HVDMX_ALLREDUCE_ALGO": "shm",
                                    "HVDMX_SHM_MIN_BYTES": "4096",
                                    "HOROVOD_SHM_CHUNK_BYTES": "65536",
                                    "HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
                                    "HVDMX_TESTING_RANKS_PER_HOST": "2"})
    assert c["allreduce_algo"] == "shm"
    assert (c["shm_min_bytes"], c["shm_chunk_bytes"]) == (4096, 65536)
    assert c["hierarchical_allreduce"] is True and c["testing_ranks_per_host"] == 2
    c = _hvdmx_testing.load_config({"HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
                                    "HVDMX_HIERARCHICAL_ALLREDUCE": "0"})
    assert c["hierarchical_allreduce"] is False


def test_round_allreduce_bytes():
    # Note [Small tensors in the round]: 4 KiB by default, 0 turns it off.
    assert _hvdmx_testing.load_config({})["round_allreduce_bytes"] == 4096
    for name, value in [("HVDMX_ROUND_ALLREDUCE_BYTES", 0),
                        ("HOROVOD_ROUND_ALLREDUCE_BYTES", 16384)]:
        assert _hvdmx_testing.load_config({name: str(value)})["round_allreduce_bytes"] == value


def test_huge_pages_variable():
    assert _hvdmx_testing.load_config({})["huge_pages"] is True
    assert _hvdmx_testing.load_config({"HVDMX_HUGE_PAGES": "0"})["huge_pages"] is False
    assert _hvdmx_testing.load_config({"HVDMX_HUGE_PAGES": "1"})["huge_pages"] is True


def test_direct_reads_between_ranks():
    assert _hvdmx_testing.load_config({})["shm_direct_min_bytes"] == "auto"
    for value, want in [("0", 0), ("-1", -1), ("1048576", 1 << 20), ("auto", "auto")]:
        c = _hvdmx_testing.load_config({"HOROVOD_SHM_DIRECT_MIN_BYTES": value})
        assert c["shm_direct_min_bytes"] == want


def test_hierarchical_adasum_is_off_unless_asked_for():
    assert _hvdmx_testing.load_config({})["adasum_hierarchical"] is False
    assert _hvdmx_testing.load_config({"HVDMX_ADASUM_HIERARCHICAL": "1"})["adasum_hierarchical"] \
        is True
    assert _hvdmx_testing.load_config({"HOROVOD_ADASUM_HIERARCHICAL": "1"})[
        "adasum_hierarchical"] is True


def test_writing_into_peers_outputs():
    assert _hvdmx_testing.load_config({})["shm_push"] is True
    assert _hvdmx_testing.load_config({"HVDMX_SHM_PUSH": "0"})["shm_push"] is False
    assert _hvdmx_testing.load_config({"HOROVOD_SHM_PUSH": "1"})["shm_push"] is True


def test_half_partials_variable():
    assert _hvdmx_testing.load_config({})["half_partials"] == "float32"
    for value in ("float32", "half"):
        assert _hvdmx_testing.load_config({"HVDMX_HALF_PARTIALS": value})["half_partials"] == value
    assert _hvdmx_testing.load_config({"HOROVOD_HALF_PARTIALS": "half"})["half_partials"] == "half"


def test_cpu_binding_variable():
    assert _hvdmx_testing.load_config({})["cpu_bind"] == "auto"
    for value in ("auto", "core", "none"):
        assert _hvdmx_testing.load_config({"HVDMX_CPU_BIND": value})["cpu_bind"] == value


@pytest.mark.parametrize("mode,cpus,local_rank,local_size,same,want", [
    # auto: once the host's ranks are at least as many as their CPUs
    ("auto", [0, 1], 0, 2, True, 0),
    ("auto", [0, 1], 1, 2, True, 1),
    ("auto", [4, 6, 9], 4, 5, True, 6),
    ("auto", [0, 1, 2, 3], 1, 3, True, -1),   # fewer ranks than CPUs
    ("auto", [0, 1], 1, 2, False, -1),        # the launcher bound them differently
    ("auto", [3], 0, 2, True, -1),            # bound to one CPU already
    ("auto", [], 0, 2, True, -1),             # the kernel did not say
    # core: whatever the counts; none: never
    ("core", [0, 1, 2, 3], 1, 3, True, 1),
    ("core", [2, 5], 3, 4, False, 5),
    ("core", [7], 0, 1, True, -1),
    ("none", [0, 1], 1, 2, True, -1),
])
def test_the_cpu_a_rank_binds_to(mode, cpus, local_rank, local_size, same, want):
    assert _hvdmx_testing.choose_cpu(mode, cpus, local_rank, local_size, same) == want


def test_streaming_stores():
    assert _hvdmx_testing.load_config({})["shm_streaming_stores"] == "auto"
    for value in ["auto", "0", "1"]:
        c = _hvdmx_testing.load_config({"HOROVOD_SHM_STREAMING_STORES": value})
        assert c["shm_streaming_stores"] == value


@pytest.mark.parametrize("name,value,accepted", [
    ("HVDMX_SHM_STREAMING_STORES", "yes", "auto, 0 (cached stores) or 1 (streaming stores)"),
    ("HOROVOD_SHM_STREAMING_STORES", "on", "auto, 0 (cached stores) or 1 (streaming stores)"),
    ("HVDMX_SHM_DIRECT_MIN_BYTES", "-2", "auto, a byte count >= 0, or -1 (never)"),
    ("HVDMX_SHM_DIRECT_MIN_BYTES", "Auto", "auto, a byte count >= 0, or -1 (never)"),
    ("HVDMX_SHM_MIN_BYTES", "-1", "a byte count >= 0"),
    ("HVDMX_ROUND_ALLREDUCE_BYTES", "-1", "a byte count from 0 (off) to 16384"),
    ("HOROVOD_ROUND_ALLREDUCE_BYTES", "16385", "a byte count from 0 (off) to 16384"),
    ("HVDMX_SHM_CHUNK_BYTES", "32", "a byte count >= 64 and <= 1073741824"),
    ("HOROVOD_SHM_CHUNK_BYTES", "2147483648", "a byte count >= 64 and <= 1073741824"),
    ("HOROVOD_HIERARCHICAL_ALLREDUCE", "yes", "0 or 1"),
    ("HVDMX_TESTING_RANKS_PER_HOST", "-2", "an integer >= 0"),
])
def test_bad_shared_memory_values(name, value, accepted):
    with pytest.raises(ValueError) as info:
        _hvdmx_testing.load_config({name: value})
    assert f"{name}='{value}'" in str(info.value) and accepted in str(info.value)


def test_secret_key_is_64_hex_digits_and_never_repeated():
    key = "0123456789abcdef" * 4
    _hvdmx_testing.load_config({"HVDMX_SECRET_KEY": key})
    _hvdmx_testing.load_config({"HOROVOD_SECRET_KEY": key.upper()})
    for bad in (key[:-2], key + "00", "z" * 64, "hunter2"):
        with pytest.raises(ValueError) as info:
            _hvdmx_testing.load_config({"HVDMX_SECRET_KEY": bad})
        message = str(info.value)
        assert "HVDMX_SECRET_KEY must be 64 hex digits" in message, message
        assert "secrets.token_hex(32)" in message
        assert bad not in message
