#include "comm/mpi_comm.h"

#include <algorithm>
#include <climits>
#include <string>

namespace hvdmx {
namespace {

void CheckMpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  HVDMX_CHECK(false, std::string(what) + " failed: " + std::string(text, len));
}

bool MpiType(DataType dtype, MPI_Datatype* out) {
  switch (dtype) {
    case DataType::kFloat32: *out = MPI_FLOAT; return true;
    case DataType::kFloat64: *out = MPI_DOUBLE; return true;
    case DataType::kUInt8: *out = MPI_UINT8_T; return true;
    case DataType::kInt8: *out = MPI_INT8_T; return true;
    case DataType::kInt32: *out = MPI_INT32_T; return true;
    case DataType::kInt64: *out = MPI_INT64_T; return true;
    case DataType::kFloat16:
    case DataType::kBFloat16: return false;
  }
  return false;
}

bool MpiOp(ReduceOp op, MPI_Op* out) {
  switch (op) {
    case ReduceOp::kAverage:
    case ReduceOp::kSum: *out = MPI_SUM; return true;
    case ReduceOp::kMin: *out = MPI_MIN; return true;
    case ReduceOp::kMax: *out = MPI_MAX; return true;
    case ReduceOp::kProduct: *out = MPI_PROD; return true;
    case ReduceOp::kAdasum: return false;
  }
  return false;
}

}  // namespace

MpiGroup::MpiGroup(MPI_Comm comm) {
  CheckMpi(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup");
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
}

MpiGroup::MpiGroup(MPI_Comm comm, Adopt) : comm_(comm) {
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
}

MpiGroup::~MpiGroup() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

std::vector<std::string> MpiGroup::Allgather(const std::string& mine) {
  return MpiAllgatherStrings(comm_, mine);
}

std::unique_ptr<Group> MpiGroup::Split(int color, int key) {
  MPI_Comm sub = MPI_COMM_NULL;
  CheckMpi(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &sub), "MPI_Comm_split");
  if (sub == MPI_COMM_NULL) return nullptr;
  return std::unique_ptr<Group>(new MpiGroup(sub, Adopt{}));
}

std::unique_ptr<Group> MpiGroup::SplitByHost() {
  MPI_Comm local = MPI_COMM_NULL;
  CheckMpi(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &local),
           "MPI_Comm_split_type");
  return std::unique_ptr<Group>(new MpiGroup(local, Adopt{}));
}

std::vector<std::string> MpiAllgatherStrings(MPI_Comm comm, const std::string& mine) {
  int size = 1;
  MPI_Comm_size(comm, &size);
  int len = static_cast<int>(mine.size());
  std::vector<int> lens(size), displs(size);
  CheckMpi(MPI_Allgather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, comm), "MPI_Allgather");
  int total = 0;
  for (int i = 0; i < size; ++i) {
    displs[i] = total;
    total += lens[i];
  }
  std::string all(total, '\0');
  CheckMpi(MPI_Allgatherv(mine.data(), len, MPI_BYTE, &all[0], lens.data(), displs.data(), MPI_BYTE,
                          comm),
           "MPI_Allgatherv");
  std::vector<std::string> out;
  for (int i = 0; i < size; ++i) out.emplace_back(all, displs[i], lens[i]);
  return out;
}

int EnsureMpiInitialized() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  int provided = 0;
  if (!initialized) {
    CheckMpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
  } else {
    MPI_Query_thread(&provided);
  }
  return provided;
}

MpiComm::MpiComm(MPI_Comm comm) {
  CheckMpi(MPI_Comm_dup(comm, &comm_), "MPI_Comm_dup");
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
}

MpiComm::~MpiComm() {
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

Comm::Request MpiComm::ISend(const void* buf, int64_t bytes, int peer) {
  HVDMX_CHECK(bytes <= kMaxMessageBytes, "message too large");
  MPI_Request req;
  CheckMpi(MPI_Isend(buf, static_cast<int>(bytes), MPI_BYTE, peer, 0, comm_, &req), "MPI_Isend");
  return Keep(req);
}

Comm::Request MpiComm::IRecv(void* buf, int64_t bytes, int peer) {
  HVDMX_CHECK(bytes <= kMaxMessageBytes, "message too large");
  MPI_Request req;
  CheckMpi(MPI_Irecv(buf, static_cast<int>(bytes), MPI_BYTE, peer, 0, comm_, &req), "MPI_Irecv");
  return Keep(req);
}

Comm::Request MpiComm::Keep(MPI_Request req) {
  if (free_slots_.empty()) {
    requests_.push_back(req);
    return static_cast<Request>(requests_.size() - 1);
  }
  Request slot = free_slots_.back();
  free_slots_.pop_back();
  requests_[slot] = req;
  return slot;
}

void MpiComm::Wait(Request request) {
  CheckMpi(MPI_Wait(&requests_[request], MPI_STATUS_IGNORE), "MPI_Wait");
  free_slots_.push_back(request);
}

void MpiComm::Bcast(void* buf, int64_t bytes, int root) {
  char* p = static_cast<char*>(buf);
  for (int64_t done = 0; done < bytes; done += kMaxMessageBytes) {
    int piece = static_cast<int>(std::min(kMaxMessageBytes, bytes - done));
    CheckMpi(MPI_Bcast(p + done, piece, MPI_BYTE, root, comm_), "MPI_Bcast");
  }
}

void MpiComm::Complete(MPI_Request* req, const char* what) {
  if (!idle_) {
    CheckMpi(MPI_Wait(req, MPI_STATUS_IGNORE), what);
    return;
  }
  for (int64_t i = 0;; ++i) {
    int done = 0;
    CheckMpi(MPI_Test(req, &done, MPI_STATUS_IGNORE), what);
    if (done) return;
    // The request stays outstanding: MPI has no way to cancel a collective.
    if (!idle_(i)) throw CommAbandoned();
  }
}

std::vector<std::string> MpiComm::Gather(const std::string& mine, int root) {
  int my_len = static_cast<int>(mine.size());
  std::vector<int> lens(rank_ == root ? size_ : 0);
  MPI_Request req;
  CheckMpi(MPI_Igather(&my_len, 1, MPI_INT, lens.data(), 1, MPI_INT, root, comm_, &req),
           "MPI_Igather");
  Complete(&req, "MPI_Igather");
  std::vector<int> displs;
  std::string all;
  if (rank_ == root) {
    displs.resize(size_);
    int64_t total = 0;
    for (int i = 0; i < size_; ++i) {
      displs[i] = static_cast<int>(total);
      total += lens[i];
    }
    HVDMX_CHECK(total < INT_MAX, "negotiation message over 2 GiB");
    all.resize(total);
  }
  CheckMpi(MPI_Igatherv(mine.data(), my_len, MPI_BYTE, &all[0], lens.data(), displs.data(),
                        MPI_BYTE, root, comm_, &req),
           "MPI_Igatherv");
  Complete(&req, "MPI_Igatherv");
  std::vector<std::string> out;
  if (rank_ == root) {
    out.reserve(size_);
    for (int i = 0; i < size_; ++i) out.emplace_back(all, displs[i], lens[i]);
  }
  return out;
}

void MpiComm::BcastString(std::string* data, int root) {
  int64_t len = static_cast<int64_t>(data->size());
  MPI_Request req;
  CheckMpi(MPI_Ibcast(&len, 1, MPI_INT64_T, root, comm_, &req), "MPI_Ibcast");
  Complete(&req, "MPI_Ibcast");
  data->resize(len);
  char* p = &(*data)[0];
  for (int64_t done = 0; done < len; done += kMaxMessageBytes) {
    const int piece = static_cast<int>(std::min(kMaxMessageBytes, len - done));
    CheckMpi(MPI_Ibcast(p + done, piece, MPI_BYTE, root, comm_, &req), "MPI_Ibcast");
    Complete(&req, "MPI_Ibcast");
  }
}

void MpiComm::StartBitAnd(uint64_t* words, int n) {
  HVDMX_CHECK(bit_and_request_ == MPI_REQUEST_NULL, "a bit-and is already outstanding");
  CheckMpi(MPI_Iallreduce(MPI_IN_PLACE, words, n, MPI_UINT64_T, MPI_BAND, comm_, &bit_and_request_),
           "MPI_Iallreduce");
}

bool MpiComm::TestBitAnd() {
  int done = 0;
  CheckMpi(MPI_Test(&bit_and_request_, &done, MPI_STATUS_IGNORE), "MPI_Test");
  return done != 0;
}

bool MpiComm::NativeAllreduce(void* buf, int64_t count, DataType dtype, ReduceOp op) {
  MPI_Datatype type;
  MPI_Op mpi_op;
  if (!MpiType(dtype, &type) || !MpiOp(op, &mpi_op)) return false;
  const int64_t elem = static_cast<int64_t>(DataTypeSize(dtype));
  const int64_t max_count = kMaxMessageBytes / elem;
  char* p = static_cast<char*>(buf);
  for (int64_t done = 0; done < count; done += max_count) {
    int piece = static_cast<int>(std::min(max_count, count - done));
    // Nonblocking and polled: measured faster for small messages than
    // MPI_Allreduce called from a non-main thread (docs/benchmark-notes.md,
    // "Small messages: latency through the whole stack").
    MPI_Request req;
    CheckMpi(MPI_Iallreduce(MPI_IN_PLACE, p + done * elem, piece, type, mpi_op, comm_, &req),
             "MPI_Iallreduce");
    int flag = 0;
    while (!flag) MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
  }
  return true;
}

}  // namespace hvdmx
