"""The rendezvous of a job started without MPI: what the launcher (or task 0
of an srun step) serves and the ranks join. Pure Python, standard library only: both sides load it,
the ranks before MXNet or MPI.

    wire          the variables, the handshake and the frames (Note [The rendezvous protocol])
    server        the server hvdmxrun --no-mpi runs on a thread
    client        a rank's side: StoreGroup, allgather and split over the server
    elastic_wire  what the elastic service and its workers both know
    srun          the tasks of a plain srun step: task 0 serves in-process, the others
                  find it through a meeting file (Note [Meeting under srun])
"""
