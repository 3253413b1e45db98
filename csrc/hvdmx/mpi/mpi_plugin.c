/* The MPI plugin, libhvdmx_mpi.so: hvdmx's MPI calls over the MPI library it
 * is built against (Note [MPI as a plugin] in mpi_plugin.h). Nothing but
 * MPI: each function converts the handles and enums and calls MPI. */
#include "mpi/mpi_plugin.h"

#include <mpi.h>
#include <string.h>

#ifndef HVDMX_MPI_VENDOR
#define HVDMX_MPI_VENDOR "unknown"
#endif

#define EXPORT __attribute__((visibility("default")))

static MPI_Comm C(hvdmx_mpi_handle h) { return (MPI_Comm)h; }
static MPI_Request R(hvdmx_mpi_handle h) { return (MPI_Request)h; }
static hvdmx_mpi_handle H(MPI_Comm c) { return (hvdmx_mpi_handle)c; }
static hvdmx_mpi_handle HR(MPI_Request r) { return (hvdmx_mpi_handle)r; }

static MPI_Datatype Type(int type) {
  switch (type) {
    case HVDMX_MPI_INT: return MPI_INT;
    case HVDMX_MPI_INT8: return MPI_INT8_T;
    case HVDMX_MPI_UINT8: return MPI_UINT8_T;
    case HVDMX_MPI_INT32: return MPI_INT32_T;
    case HVDMX_MPI_INT64: return MPI_INT64_T;
    case HVDMX_MPI_UINT64: return MPI_UINT64_T;
    case HVDMX_MPI_FLOAT: return MPI_FLOAT;
    case HVDMX_MPI_DOUBLE: return MPI_DOUBLE;
    default: return MPI_BYTE;
  }
}

static MPI_Op Op(int op) {
  switch (op) {
    case HVDMX_MPI_MIN: return MPI_MIN;
    case HVDMX_MPI_MAX: return MPI_MAX;
    case HVDMX_MPI_PROD: return MPI_PROD;
    case HVDMX_MPI_BAND: return MPI_BAND;
    default: return MPI_SUM;
  }
}

static int InitThread(int* provided, int* multiple) {
  int initialized = 0, rc = MPI_Initialized(&initialized);
  if (rc != MPI_SUCCESS) return rc;
  rc = initialized ? MPI_Query_thread(provided)
                   : MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, provided);
  *multiple = *provided >= MPI_THREAD_MULTIPLE;
  return rc;
}

static int Finalized(int* flag) { return MPI_Finalized(flag); }

static void ErrorString(int code, char* text, int capacity) {
  char buffer[MPI_MAX_ERROR_STRING + 1];
  int len = 0;
  if (capacity <= 0) return;
  if (MPI_Error_string(code, buffer, &len) != MPI_SUCCESS) len = 0;
  if (len > capacity - 1) len = capacity - 1;
  memcpy(text, buffer, (size_t)len);
  text[len] = '\0';
}

static hvdmx_mpi_handle CommAt(const void* address) {
  return address ? H(*(const MPI_Comm*)address) : H(MPI_COMM_WORLD);
}

static int CommDup(hvdmx_mpi_handle comm, hvdmx_mpi_handle* out) {
  MPI_Comm dup = MPI_COMM_NULL;
  int rc = MPI_Comm_dup(C(comm), &dup);
  *out = H(dup);
  return rc;
}

static int CommFree(hvdmx_mpi_handle* comm) {
  MPI_Comm c = C(*comm);
  int rc = MPI_Comm_free(&c);
  *comm = H(c);
  return rc;
}

static int CommRank(hvdmx_mpi_handle comm, int* rank) { return MPI_Comm_rank(C(comm), rank); }
static int CommSize(hvdmx_mpi_handle comm, int* size) { return MPI_Comm_size(C(comm), size); }

static int CommSplit(hvdmx_mpi_handle comm, int color, int key, hvdmx_mpi_handle* out) {
  MPI_Comm sub = MPI_COMM_NULL;
  int rc = MPI_Comm_split(C(comm), color < 0 ? MPI_UNDEFINED : color, key, &sub);
  *out = H(sub);
  return rc;
}

static int CommSplitHost(hvdmx_mpi_handle comm, int key, hvdmx_mpi_handle* out) {
  MPI_Comm local = MPI_COMM_NULL;
  int rc = MPI_Comm_split_type(C(comm), MPI_COMM_TYPE_SHARED, key, MPI_INFO_NULL, &local);
  *out = H(local);
  return rc;
}

static int Isend(const void* buf, int bytes, int peer, hvdmx_mpi_handle comm,
                 hvdmx_mpi_handle* request) {
  MPI_Request r = MPI_REQUEST_NULL;
  int rc = MPI_Isend(buf, bytes, MPI_BYTE, peer, 0, C(comm), &r);
  *request = HR(r);
  return rc;
}

static int Irecv(void* buf, int bytes, int peer, hvdmx_mpi_handle comm, hvdmx_mpi_handle* request) {
  MPI_Request r = MPI_REQUEST_NULL;
  int rc = MPI_Irecv(buf, bytes, MPI_BYTE, peer, 0, C(comm), &r);
  *request = HR(r);
  return rc;
}

static int Wait(hvdmx_mpi_handle* request) {
  MPI_Request r = R(*request);
  int rc = MPI_Wait(&r, MPI_STATUS_IGNORE);
  *request = HR(r);
  return rc;
}

static int Test(hvdmx_mpi_handle* request, int* done) {
  MPI_Request r = R(*request);
  int rc = MPI_Test(&r, done, MPI_STATUS_IGNORE);
  *request = HR(r);
  return rc;
}

static int Bcast(void* buf, int count, int type, int root, hvdmx_mpi_handle comm) {
  return MPI_Bcast(buf, count, Type(type), root, C(comm));
}

static int Ibcast(void* buf, int count, int type, int root, hvdmx_mpi_handle comm,
                  hvdmx_mpi_handle* request) {
  MPI_Request r = MPI_REQUEST_NULL;
  int rc = MPI_Ibcast(buf, count, Type(type), root, C(comm), &r);
  *request = HR(r);
  return rc;
}

static int Allgather(const void* mine, int count, int type, void* all, hvdmx_mpi_handle comm) {
  return MPI_Allgather(mine, count, Type(type), all, count, Type(type), C(comm));
}

static int Allgatherv(const void* mine, int bytes, void* all, const int* counts, const int* displs,
                      hvdmx_mpi_handle comm) {
  return MPI_Allgatherv(mine, bytes, MPI_BYTE, all, counts, displs, MPI_BYTE, C(comm));
}

static int Igather(const void* mine, int count, int type, void* all, int root,
                   hvdmx_mpi_handle comm, hvdmx_mpi_handle* request) {
  MPI_Request r = MPI_REQUEST_NULL;
  int rc = MPI_Igather(mine, count, Type(type), all, count, Type(type), root, C(comm), &r);
  *request = HR(r);
  return rc;
}

static int Igatherv(const void* mine, int bytes, void* all, const int* counts, const int* displs,
                    int root, hvdmx_mpi_handle comm, hvdmx_mpi_handle* request) {
  MPI_Request r = MPI_REQUEST_NULL;
  int rc = MPI_Igatherv(mine, bytes, MPI_BYTE, all, counts, displs, MPI_BYTE, root, C(comm), &r);
  *request = HR(r);
  return rc;
}

static int Iallreduce(void* buf, int count, int type, int op, hvdmx_mpi_handle comm,
                      hvdmx_mpi_handle* request) {
  MPI_Request r = MPI_REQUEST_NULL;
  int rc = MPI_Iallreduce(MPI_IN_PLACE, buf, count, Type(type), Op(op), C(comm), &r);
  *request = HR(r);
  return rc;
}

EXPORT const struct hvdmx_mpi_api* hvdmx_mpi_plugin(void) {
  /* Filled on the first call: MPI_COMM_NULL and MPI_REQUEST_NULL are not
     constant expressions in Open MPI (addresses of its objects). */
  static struct hvdmx_mpi_api api;
  if (api.abi == 0) {
    api.vendor = HVDMX_MPI_VENDOR;
    api.success = MPI_SUCCESS;
    api.comm_null = H(MPI_COMM_NULL);
    api.request_null = HR(MPI_REQUEST_NULL);
    api.init_thread = InitThread;
    api.finalized = Finalized;
    api.error_string = ErrorString;
    api.comm_at = CommAt;
    api.comm_dup = CommDup;
    api.comm_free = CommFree;
    api.comm_rank = CommRank;
    api.comm_size = CommSize;
    api.comm_split = CommSplit;
    api.comm_split_host = CommSplitHost;
    api.isend = Isend;
    api.irecv = Irecv;
    api.wait = Wait;
    api.test = Test;
    api.bcast = Bcast;
    api.ibcast = Ibcast;
    api.allgather = Allgather;
    api.allgatherv = Allgatherv;
    api.igather = Igather;
    api.igatherv = Igatherv;
    api.iallreduce = Iallreduce;
    api.abi = HVDMX_MPI_PLUGIN_ABI;
  }
  return &api;
}
