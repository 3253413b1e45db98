#!/usr/bin/env python3
"""hvdmxrun's remote shell inside a Slurm allocation (--no-mpi and elastic
jobs whose hosts come from the allocation): called as ssh is,

    srun_shell.py [ssh options] HOST COMMAND...

it runs COMMAND (the words joined by spaces, with sh -c) on HOST as a step
of one task of the job, `srun --nodes=1 --ntasks=1 --nodelist=HOST
--overlap`: no ssh between the nodes is needed, Slurm accounts for the
rank and ends it with the job, and the standard input (where hvdmxrun
sends the job's key) reaches the task. The standard library only: it runs
under any python3."""
import os
import sys

# ssh's options that take a value (the others are flags).
_WITH_VALUE = set("bcDEeFIiJLlmOopQRSWw")


def srun_command(argv):
    """The srun argument list for ssh-style `argv`, or raises ValueError."""
    args = list(argv)
    while args and args[0].startswith("-"):
        option = args.pop(0)
        if len(option) == 2 and option[1] in _WITH_VALUE and args:
            args.pop(0)
    if len(args) < 2:
        raise ValueError("usage: srun_shell.py [ssh options] HOST COMMAND...")
    host, command = args[0], " ".join(args[1:])
    return ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={host}", "--overlap",
            "--mpi=none", "--quiet", "--kill-on-bad-exit=1", "sh", "-c", command]


def main(argv):
    try:
        cmd = srun_command(argv)
    except ValueError as error:
        print(f"hvdmxrun's srun shell: {error}", file=sys.stderr)
        return 255
    try:
        os.execvp(cmd[0], cmd)
    except OSError as error:
        print(f"hvdmxrun's srun shell: cannot run srun ({error}); run hvdmxrun inside a Slurm "
              "allocation where srun is on PATH, or name a remote shell with --ssh-exec",
              file=sys.stderr)
        return 255


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
