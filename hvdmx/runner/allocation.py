"""The hosts a scheduler gave the job, for hvdmxrun without -H or --hostfile:
- a hostfile named by the variable an MPI launcher reads it from, as the
  Kubernetes MPI Operator sets them (docs/clusters.md):
  OMPI_MCA_orte_default_hostfile (Open MPI), HYDRA_HOST_FILE (MPICH's Hydra),
  I_MPI_HYDRA_HOST_FILE (Intel MPI); the first one set, in that order;
- else the Slurm allocation this process runs in (hvdmx/runner/slurm.py).
The hosts come back with the name of where they came from, which hvdmxrun's
messages and --dry-run use as they use "-H" or "--hostfile". Without MPI,
hvdmxrun reaches the nodes of a Slurm allocation through srun
(srun_shell.py), not ssh.
"""
from __future__ import annotations

import os
from typing import List, Mapping, Optional, Tuple

from hvdmx.runner.hosts import Host, read_hostfile
from hvdmx.runner.slurm import NODELIST, TASKS, allocation

# hvdmxrun's remote shell for the nodes of a Slurm allocation (srun steps).
SRUN_SHELL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "srun_shell.py")
SLURM_HOSTS = f"the Slurm allocation ({NODELIST}, {TASKS})"
HOSTFILE_VARIABLES = ("OMPI_MCA_orte_default_hostfile", "HYDRA_HOST_FILE",
                      "I_MPI_HYDRA_HOST_FILE")


def scheduler_hosts(environ: Mapping[str, str]) -> Tuple[Optional[List[Host]], str]:
    """(hosts, where they come from) from the environment, or (None, '')
    when it names none. UsageError for a named hostfile that cannot be read
    or parsed, or a malformed Slurm allocation."""
    for variable in HOSTFILE_VARIABLES:
        path = environ.get(variable)
        if path:
            return read_hostfile(path, flag=variable), f"{variable}={path}"
    found = allocation(environ)
    if found is None:
        return None, ""
    return found.hosts, SLURM_HOSTS


def scheduler_shell(ssh_exec: Optional[str], where: str) -> Optional[str]:
    """The remote shell hvdmxrun starts ranks with when it starts them itself:
    --ssh-exec when given, else srun's steps for hosts from a Slurm
    allocation (no ssh needed), else None (ssh)."""
    if ssh_exec is None and where == SLURM_HOSTS:
        return SRUN_SHELL
    return ssh_exec
