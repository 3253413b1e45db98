"""The core's status codes as the Python layer reads them (hvdmx/_job.py):
each code maps to one exception class and to one exit path, by the code
alone, never by the message's text. Whole jobs that stop for each reason are
in tests/test_process_exit.py, which also checks the code each one reports."""
import os
import subprocess
import sys

import mxnet as mx
import pytest

import hvdmx as hvd
from hvdmx import _core, _job, errors

CODES = {name: getattr(_core, name) for name in dir(_core) if name.startswith("STATUS_")}

# What each code must raise, and whether the peers may be gone after a
# runtime stopped with it (the bounded MPI_Finalize at exit).
EXPECTED = {
    "STATUS_INVALID_ARGUMENT": (errors.InvalidArgumentError, False),
    "STATUS_MISMATCH": (errors.MismatchError, False),
    "STATUS_SHUTDOWN": (mx.base.MXNetError, False),
    "STATUS_INTERNAL": (mx.base.MXNetError, False),
    "STATUS_PEER_SHUTDOWN": (mx.base.MXNetError, False),
    "STATUS_STALLED": (mx.base.MXNetError, True),
    "STATUS_PEER_GONE": (mx.base.MXNetError, True),
    "STATUS_PEER_PROTOCOL": (errors.PeerProtocolError, True),
}


def test_the_codes_are_distinct_and_all_known():
    assert len(set(CODES.values())) == len(CODES)
    assert CODES["STATUS_OK"] == 0
    assert sorted(CODES) == sorted([*EXPECTED, "STATUS_OK"])


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_code_maps_to_its_class_and_exit(name):
    cls, gone = EXPECTED[name]
    error = _job.error_for(CODES[name], "the core's message")
    assert type(error) is cls and str(error) == "the core's message"
    assert _job.peers_gone(CODES[name]) is gone


def test_a_peer_that_broke_the_protocol_is_caught_as_a_lost_peer_is_but_not_recovered():
    # Code written for a failed collective (MXNetError, or RuntimeError as Horovod's
    # HorovodInternalError is) catches it; hvd.elastic.run resets after a lost peer
    # only, and a call after the stop raises the PeerProtocolError itself.
    assert hvd.PeerProtocolError is errors.PeerProtocolError
    assert "PeerProtocolError" in hvd.__all__ and "PeerProtocolError" in errors.__all__
    assert issubclass(errors.PeerProtocolError, mx.base.MXNetError)
    assert issubclass(errors.PeerProtocolError, RuntimeError)
    assert _job.recoverable(_core.STATUS_PEER_GONE) and _job.recoverable(_core.STATUS_STALLED)
    assert not _job.recoverable(_core.STATUS_PEER_PROTOCOL)
    assert _job.protocol_error() is None  # not stopped


def test_a_secret_key_of_another_length_from_rank_0_fails_init_naming_it():
    # The key rank 0 broadcasts (job/secret_key.cc) is peer input: rank 1's
    # AgreeOnSecretKey, given 31 or 33 bytes by a scripted rank 0, fails with
    # kPeerProtocol naming rank 0 and the length, and keeps no key.
    import _hvdmx_testing as t
    code, message, key = t.agree_on_key_from_liar(b"k" * 32)
    assert (code, message, len(key)) == (_core.STATUS_OK, "", 32)
    for length in (0, 31, 33, 2**20):
        code, message, key = t.agree_on_key_from_liar(b"k" * length)
        assert code == _core.STATUS_PEER_PROTOCOL and key == b"", (length, message)
        assert f"rank 0 sent a secret key of {length} bytes where 32 were expected" in message
        assert type(_job.error_for(code, message)) is errors.PeerProtocolError
    # hvd.init()'s way to Python (InitStatus, ThrowIfError): the class itself.
    with pytest.raises(hvd.PeerProtocolError, match="rank 0 sent a secret key of 31 bytes"):
        t.init_key_from_liar(b"k" * 31)


def test_the_message_decides_nothing():
    # The old markers of a stall and of a gone peer, under codes that mean
    # neither: the exit path follows the code.
    stall = ("hvdmx: the other ranks have not taken part in negotiation for 2 s; hvdmx: the "
             "connection to rank 1 was closed, while this rank waited for it in shared memory")
    assert not _job.peers_gone(_core.STATUS_PEER_SHUTDOWN)
    assert type(_job.error_for(_core.STATUS_MISMATCH, stall)) is errors.MismatchError
    assert type(_job.error_for(_core.STATUS_SHUTDOWN, "a mismatch")) is mx.base.MXNetError


def test_stop_status_while_not_running():
    assert _core.stop_status() == (_core.STATUS_OK, "")
    with pytest.raises(errors.NotRunningError, match="not been initialized"):
        hvd.allreduce(mx.nd.ones((1,)))


@pytest.mark.parametrize("env, seconds", [({}, 5.0),
                                          ({"HVDMX_STALL_SHUTDOWN_TIME_SECONDS": "7.5"}, 7.5),
                                          ({"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "9"}, 9.0)])
def test_the_finalize_grace_asks_the_core(env, seconds):
    # The core reads the setting at init (csrc/hvdmx/config/env_config.h);
    # Python asks it, and does not read the environment again.
    code = ("import hvdmx as hvd\n"
            "from hvdmx import _core, basics\n"
            "hvd.init()\n"
            "print(_core.stall_shutdown_seconds(), basics._finalize_grace())\n"
            "hvd.shutdown()\n")
    environ = {k: v for k, v in os.environ.items() if "STALL_SHUTDOWN" not in k}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, env=dict(environ, **env))
    assert result.returncode == 0, result.stderr
    configured, grace = map(float, result.stdout.split())
    assert configured == (float(next(iter(env.values()))) if env else 0.0)
    assert grace == seconds

