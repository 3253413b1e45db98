"""hvdmxrun and what starts a job: the launcher's side, apart from what a
rank imports. Nothing here loads MXNet or the rank API (hvdmx/__init__,
ops, trainer, ...); the rank API never imports this package
(tests/test_layers.py checks both).

    launch        hvdmxrun's command line and main (``python -m hvdmx.run`` runs it)
    flags         the tuning flags and the variables they set
    hosts         -H, the hostfile, the checks of each host
    mpi           the MPI launcher: which one, its command and environment
    nompi         --no-mpi: starts the ranks itself, serves the rendezvous
    bootstrap     what each rank of --no-mpi runs first (python -m hvdmx.runner.bootstrap)
    function_job  run_function (Horovod's horovod.run): a function on every rank
    elastic/      the launcher's side of elastic: hosts, membership, service, loop, job
    slurm         a Slurm allocation's nodes and tasks (SLURM_JOB_NODELIST, ...)
    allocation    the hosts a scheduler gave the job: Slurm's, or an MPI hostfile's
    srun_shell    --no-mpi's remote shell inside a Slurm allocation: srun steps
"""
