"""The program that hvdmxrun --no-mpi (and an elastic job) starts for each
rank, on the rank's host, before the rank's own command:

    PYTHON -m hvdmx.runner.bootstrap COMMAND ...

Standard library only, and nothing of hvdmx but this module: it runs before
the rank's environment is in place (See Note [The rank's bootstrap]).

Note [The rank's bootstrap]
Every rank runs as `PYTHON -m hvdmx.runner.bootstrap COMMAND...` with its
standard input a pipe from hvdmxrun (through ssh for another host). The
bootstrap reads one line, a JSON object of variables (the job's secret key,
and for a rank on another host its HVDMX_* variables and what hvdmxrun
forwards of its own environment), puts them into the environment, and runs
COMMAND in its own process group, with standard input from /dev/null. So
the key is on no command line, and the command a user reads in --dry-run
is one short line. The variables the interpreter needs before it can run
this module (PYTHONPATH, which finds hvdmx, and LD_LIBRARY_PATH, which may
find libpython) are on the command line instead (nompi.rank_command). The
bootstrap then stops that group (SIGTERM; SIGKILL after 5 s) when it gets
SIGTERM, SIGINT or SIGHUP, or when its standard input ends: hvdmxrun closes
the pipe when it stops the job, and the pipe ends by itself when hvdmxrun
or ssh dies, so that no rank outlives its launcher, even one killed with
SIGKILL. It exits with COMMAND's status (128 + N for signal N), after
ending what COMMAND left running in its group; 125 when its first line is
missing or malformed, 127 when COMMAND cannot start.
"""
import json
import os
import signal
import subprocess
import sys
import threading
from typing import Dict, List, NoReturn

# The first line's limit: a rank's variables, the launcher's PATH among them.
MAX_LINE_BYTES = 1 << 20
STOP_SECONDS = 5.0  # after SIGTERM to COMMAND's group, before SIGKILL


def variables_line(variables: Dict[str, str]) -> bytes:
    """The first line hvdmxrun writes to a rank's bootstrap."""
    return json.dumps(variables, sort_keys=True).encode() + b"\n"


def parse_variables(line: bytes) -> Dict[str, str]:
    """The variables of a first line; ValueError naming what is wrong."""
    try:
        variables = json.loads(line.decode())
    except (UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"its first line is not a JSON object ({error})") from None
    if not isinstance(variables, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and k and "=" not in k and
            "\0" not in k + v for k, v in variables.items()):
        raise ValueError("its first line must be a JSON object of variable names (non-empty, "
                         "without '=') to string values")
    return variables


def _fail(code: int, text: str) -> NoReturn:
    print(f"hvdmxrun: the rank's bootstrap on {os.uname().nodename}: {text}",
          file=sys.stderr, flush=True)
    os._exit(code)


def _read_line() -> bytes:
    line = b""
    while not line.endswith(b"\n"):
        byte = os.read(0, 1)
        if not byte:
            os._exit(125)  # hvdmxrun went away before the line: nothing to say it to
        line += byte
        if len(line) > MAX_LINE_BYTES:
            _fail(125, f"its first line is over {MAX_LINE_BYTES} bytes")
    return line


def main(command: List[str]) -> NoReturn:
    if not command:
        _fail(2, "no command given; hvdmxrun starts it as: python -m hvdmx.runner.bootstrap "
                 "COMMAND ...")
    try:
        variables = parse_variables(_read_line())
    except ValueError as error:
        _fail(125, str(error))
    os.environ.update(variables)
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    group = os.getpgrp()
    stopping: List[int] = []

    def stop(*_) -> None:
        if stopping:
            return
        stopping.append(1)
        try:
            os.killpg(group, signal.SIGTERM)
        except OSError:
            pass
        timer = threading.Timer(STOP_SECONDS, os.killpg, (group, signal.SIGKILL))
        timer.daemon = True
        timer.start()

    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(number, stop)

    def watch() -> None:
        while os.read(0, 4096):
            pass
        stop()

    try:
        rank = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    except OSError as error:
        print(f"hvdmxrun: cannot start {command[0]!r} on {os.uname().nodename}: {error}",
              file=sys.stderr, flush=True)
        os._exit(127)
    threading.Thread(target=watch, daemon=True).start()
    code = rank.wait()
    stopping.append(1)
    try:
        os.killpg(group, signal.SIGTERM)
    except OSError:
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 - code if code < 0 else code)


if __name__ == "__main__":
    main(sys.argv[1:])
