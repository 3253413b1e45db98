"""libcrypto found at run time (Note [Loading libcrypto at run time] in
csrc/hvdmx/base/crypto.cc): the core links no OpenSSL, opens libcrypto.so.3 or
libcrypto.so.1.1 on first use, or the one HVDMX_LIBCRYPTO names; without a usable
one, the first use fails with an error naming the library and the fix. The
handshake's own tests (test_tcp_handshake.py) check the HMAC it computes against
Python's."""
import ctypes.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")

pytestmark = pytest.mark.timeout(120)

# A connector's first step draws its nonce (RAND_bytes); the pair then proves the
# key both ways (HMAC-SHA256 and CRYPTO_memcmp).
HANDSHAKE = f"""
import sys
sys.path.insert(0, {TESTS!r})
import _hvdmx_testing as t
key, comm_id = b"k" * 32, bytes(16)
c = t.Handshake.connector(key, comm_id, 0, self=0, size=2, peer=1)
a = t.Handshake.acceptor(key, comm_id, 0, self=1)
for _ in range(10):
    for x, y in ((c, a), (a, c)):
        out = x.output()
        if out and y.want():
            n = min(len(out), y.want())
            y.feed(out[:n])
            x.sent(n)
print(c.state(), a.state())
"""


def handshake(libcrypto):
    env = {k: v for k, v in os.environ.items() if k != "HVDMX_LIBCRYPTO"}
    if libcrypto is not None:
        env["HVDMX_LIBCRYPTO"] = libcrypto
    return subprocess.run([sys.executable, "-c", HANDSHAKE], env=env, capture_output=True,
                          text=True, timeout=60, check=False)


def test_the_core_links_no_libcrypto():
    import hvdmx._mpi
    core = hvdmx._mpi.load_core()
    library = os.path.join(os.path.dirname(core.__file__), "libhvdmx_core.so")
    with open(library, "rb") as f:
        assert b"libcrypto.so.3" in f.read()  # the sonames it opens...
    for path in (core.__file__, library):
        needed = subprocess.run(["readelf", "-d", path], capture_output=True, text=True,
                                check=True).stdout
        assert "(NEEDED)" in needed and "libcrypto" not in needed, needed  # ...none it needs


@pytest.mark.parametrize("libcrypto", [None, "soname", "path"])
def test_the_system_libcrypto_or_the_one_named_authenticates(libcrypto):
    found = ctypes.util.find_library("crypto")  # "libcrypto.so.3" here
    assert found, "no libcrypto on this machine"
    if libcrypto == "soname":
        libcrypto = found
    elif libcrypto == "path":
        libcrypto = next(os.path.join(d, found) for d in
                         ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib64",
                          "/usr/lib") if os.path.exists(os.path.join(d, found)))
    result = handshake(libcrypto)
    assert (result.returncode, result.stdout) == (0, "done done\n"), result.stderr


def test_no_libcrypto_fails_naming_what_was_tried_and_the_fix(tmp_path):
    missing = str(tmp_path / "libcrypto.so.3")
    result = handshake(missing)
    assert result.returncode == 1
    assert ("RuntimeError: hvdmx: cannot load OpenSSL's libcrypto, which authenticates the "
            f"connections between ranks ({missing}: cannot open shared object file") \
        in result.stderr, result.stderr
    assert "install OpenSSL's library (Debian/Ubuntu: apt-get install libssl3" in result.stderr
    assert "or set HVDMX_LIBCRYPTO to the path of a libcrypto.so" in result.stderr


def test_a_library_that_is_not_libcrypto_fails_naming_the_missing_function():
    result = handshake("libm.so.6")
    assert result.returncode == 1
    assert ("RuntimeError: hvdmx: libm.so.6 has no function RAND_bytes (is it OpenSSL's "
            "libcrypto, version 1.1 or 3?); install OpenSSL's library") in result.stderr, \
        result.stderr
