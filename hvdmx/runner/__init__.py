"""hvdmxrun and what starts a job: the launcher's side, apart from what a
rank imports. Nothing here loads MXNet or the rank API.

    slurm         a Slurm allocation's nodes and tasks (SLURM_JOB_NODELIST, ...)
    allocation    the hosts a scheduler gave the job: Slurm's, or an MPI hostfile's
"""
