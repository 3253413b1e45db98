// The MPI plugin's interface: every MPI call hvdmx makes, as a table of C
// functions that the plugin libhvdmx_mpi.so (mpi_plugin.c, the one source
// that includes mpi.h) fills, and the core (comm/mpi_comm.cc) calls through.
//
// Note [MPI as a plugin]
// ~~~~~~~~~~~~~~~~~~~~~
// The core links no MPI library: a job started with hvdmxrun --no-mpi then
// needs none installed, and `import hvdmx` loads none. When a job uses MPI,
// the Python side (hvdmx/_mpi.py, load_mpi) has mpi4py load the MPI library
// first, then has the core open the plugin built for that library's family
// (comm/mpi_library.cc): it links libmpi by soname, so the loader binds it to
// the library mpi4py loaded. MPICH's and Open MPI's ABIs differ (MPICH's
// handles are integers, Open MPI's pointers), so a binary wheel holds one
// plugin for each: libhvdmx_mpi.so (MPICH's libmpi.so.12) and
// libhvdmx_mpi.openmpi.so (libmpi.so.40); the core and the module are built
// once. The plugin is plain C: no C++ object or exception crosses between it
// and the core, so each may carry its own runtime (the wheel's zig-built
// core links libc++ statically).
//
// Handles (MPI_Comm, MPI_Request) cross as intptr_t, which holds either
// kind. Every function returns MPI's error code (`success` when it worked);
// counts are MPI's ints, the caller keeps them in range.
#ifndef HVDMX_MPI_PLUGIN_H_
#define HVDMX_MPI_PLUGIN_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Raised whenever the table changes; the core refuses any other. */
#define HVDMX_MPI_PLUGIN_ABI 1

typedef intptr_t hvdmx_mpi_handle;

enum hvdmx_mpi_type {
  HVDMX_MPI_BYTE,
  HVDMX_MPI_INT,
  HVDMX_MPI_INT8,
  HVDMX_MPI_UINT8,
  HVDMX_MPI_INT32,
  HVDMX_MPI_INT64,
  HVDMX_MPI_UINT64,
  HVDMX_MPI_FLOAT,
  HVDMX_MPI_DOUBLE
};

enum hvdmx_mpi_op { HVDMX_MPI_SUM, HVDMX_MPI_MIN, HVDMX_MPI_MAX, HVDMX_MPI_PROD, HVDMX_MPI_BAND };

struct hvdmx_mpi_api {
  int abi;            /* HVDMX_MPI_PLUGIN_ABI */
  const char* vendor; /* "MPICH 5.0.2", "Open MPI 4.1.8": read from mpi.h when built */
  int success;        /* MPI_SUCCESS */
  hvdmx_mpi_handle comm_null, request_null;

  /* Initializes MPI with MPI_THREAD_MULTIPLE unless it already is; the level
     provided, and whether it is MPI_THREAD_MULTIPLE. */
  int (*init_thread)(int* provided, int* multiple);
  int (*finalized)(int* flag);
  /* MPI's text for an error code, always terminated. */
  void (*error_string)(int code, char* text, int capacity);

  /* MPI_COMM_WORLD, or the communicator stored at `address` (mpi4py's
     MPI._addressof(comm)) when it is not null. */
  hvdmx_mpi_handle (*comm_at)(const void* address);
  int (*comm_dup)(hvdmx_mpi_handle comm, hvdmx_mpi_handle* out);
  int (*comm_free)(hvdmx_mpi_handle* comm);
  int (*comm_rank)(hvdmx_mpi_handle comm, int* rank);
  int (*comm_size)(hvdmx_mpi_handle comm, int* size);
  /* MPI_Comm_split; color < 0 is MPI_UNDEFINED (*out: comm_null). */
  int (*comm_split)(hvdmx_mpi_handle comm, int color, int key, hvdmx_mpi_handle* out);
  /* MPI_Comm_split_type(MPI_COMM_TYPE_SHARED): the ranks of one host. */
  int (*comm_split_host)(hvdmx_mpi_handle comm, int key, hvdmx_mpi_handle* out);

  /* Point to point: bytes, tag 0. */
  int (*isend)(const void* buf, int bytes, int peer, hvdmx_mpi_handle comm,
               hvdmx_mpi_handle* request);
  int (*irecv)(void* buf, int bytes, int peer, hvdmx_mpi_handle comm, hvdmx_mpi_handle* request);
  int (*wait)(hvdmx_mpi_handle* request);
  int (*test)(hvdmx_mpi_handle* request, int* done);

  int (*bcast)(void* buf, int count, int type, int root, hvdmx_mpi_handle comm);
  int (*ibcast)(void* buf, int count, int type, int root, hvdmx_mpi_handle comm,
                hvdmx_mpi_handle* request);
  int (*allgather)(const void* mine, int count, int type, void* all, hvdmx_mpi_handle comm);
  /* Bytes, every rank's counts and displacements given. */
  int (*allgatherv)(const void* mine, int bytes, void* all, const int* counts, const int* displs,
                    hvdmx_mpi_handle comm);
  int (*igather)(const void* mine, int count, int type, void* all, int root, hvdmx_mpi_handle comm,
                 hvdmx_mpi_handle* request);
  int (*igatherv)(const void* mine, int bytes, void* all, const int* counts, const int* displs,
                  int root, hvdmx_mpi_handle comm, hvdmx_mpi_handle* request);
  /* In place. */
  int (*iallreduce)(void* buf, int count, int type, int op, hvdmx_mpi_handle comm,
                    hvdmx_mpi_handle* request);
};

/* The plugin's one exported symbol. */
const struct hvdmx_mpi_api* hvdmx_mpi_plugin(void);

#ifdef __cplusplus
}
#endif

#endif /* HVDMX_MPI_PLUGIN_H_ */
