#include "comm/mpi_comm.h"

#include <algorithm>
#include <climits>
#include <string>

#include "comm/peer_input.h"

namespace hvdmx {
namespace {

void CheckMpi(const hvdmx_mpi_api& mpi, int rc, const char* what) {
  if (rc == mpi.success) return;
  char text[512];
  mpi.error_string(rc, text, sizeof(text));
  HVDMX_CHECK(false, std::string(what) + " failed: " + text);
}

// The displacements of a gather whose ranks sent `lens` (peer input: each
// length in [0, DataComm::kMaxMessageBytes], all of them within MPI's int
// displacements), and their total in *total; a bad one fails naming its rank.
std::vector<int> GatherDisplacements(const std::vector<int>& lens, const char* message,
                                     int64_t* total) {
  std::vector<int> displs(lens.size());
  *total = 0;
  for (size_t i = 0; i < lens.size(); ++i) {
    const int rank = static_cast<int>(i);
    if (lens[i] < 0 || lens[i] > DataComm::kMaxMessageBytes) {
      FailPeerInput(PeerSender::Rank(rank),
                    std::string(message) + " of " + std::to_string(lens[i]) + " bytes where 0 to " +
                        std::to_string(DataComm::kMaxMessageBytes) + " may be");
    }
    if (*total + lens[i] > INT_MAX) {
      FailPeerInput(PeerSender::Rank(rank),
                    std::string(message) + " of " + std::to_string(lens[i]) + " bytes after " +
                        std::to_string(*total) + " from the ranks before it: over 2 GiB in all");
    }
    displs[i] = static_cast<int>(*total);
    *total += lens[i];
  }
  return displs;
}

bool MpiType(DataType dtype, int* out) {
  switch (dtype) {
    case DataType::kFloat32: *out = HVDMX_MPI_FLOAT; return true;
    case DataType::kFloat64: *out = HVDMX_MPI_DOUBLE; return true;
    case DataType::kUInt8: *out = HVDMX_MPI_UINT8; return true;
    case DataType::kInt8: *out = HVDMX_MPI_INT8; return true;
    case DataType::kInt32: *out = HVDMX_MPI_INT32; return true;
    case DataType::kInt64: *out = HVDMX_MPI_INT64; return true;
    case DataType::kFloat16:
    case DataType::kBFloat16: return false;
  }
  return false;
}

bool MpiOp(ReduceOp op, int* out) {
  switch (op) {
    case ReduceOp::kAverage:
    case ReduceOp::kSum: *out = HVDMX_MPI_SUM; return true;
    case ReduceOp::kMin: *out = HVDMX_MPI_MIN; return true;
    case ReduceOp::kMax: *out = HVDMX_MPI_MAX; return true;
    case ReduceOp::kProduct: *out = HVDMX_MPI_PROD; return true;
    case ReduceOp::kAdasum: return false;
  }
  return false;
}

}  // namespace

MpiGroup::MpiGroup(hvdmx_mpi_handle comm) : mpi_(Mpi()), comm_(mpi_.comm_null) {
  CheckMpi(mpi_, mpi_.comm_dup(comm, &comm_), "MPI_Comm_dup");
  mpi_.comm_rank(comm_, &rank_);
  mpi_.comm_size(comm_, &size_);
}

MpiGroup::MpiGroup(hvdmx_mpi_handle comm, Adopt) : mpi_(Mpi()), comm_(comm) {
  mpi_.comm_rank(comm_, &rank_);
  mpi_.comm_size(comm_, &size_);
}

MpiGroup::~MpiGroup() {
  int finalized = 0;
  mpi_.finalized(&finalized);
  if (!finalized && comm_ != mpi_.comm_null) mpi_.comm_free(&comm_);
}

std::vector<std::string> MpiGroup::Allgather(const std::string& mine) {
  return MpiAllgatherStrings(comm_, mine);
}

std::unique_ptr<Group> MpiGroup::Split(int color, int key) {
  hvdmx_mpi_handle sub = mpi_.comm_null;
  CheckMpi(mpi_, mpi_.comm_split(comm_, color, key, &sub), "MPI_Comm_split");
  if (sub == mpi_.comm_null) return nullptr;
  return std::unique_ptr<Group>(new MpiGroup(sub, Adopt{}));
}

std::unique_ptr<Group> MpiGroup::SplitByHost() {
  hvdmx_mpi_handle local = mpi_.comm_null;
  CheckMpi(mpi_, mpi_.comm_split_host(comm_, rank_, &local), "MPI_Comm_split_type");
  return std::unique_ptr<Group>(new MpiGroup(local, Adopt{}));
}

std::vector<std::string> MpiAllgatherStrings(hvdmx_mpi_handle comm, const std::string& mine) {
  const hvdmx_mpi_api& mpi = Mpi();
  int size = 1;
  mpi.comm_size(comm, &size);
  int len = static_cast<int>(mine.size());
  std::vector<int> lens(size);
  CheckMpi(mpi, mpi.allgather(&len, 1, HVDMX_MPI_INT, lens.data(), comm), "MPI_Allgather");
  int64_t total = 0;
  const std::vector<int> displs = GatherDisplacements(lens, "a string for the group", &total);
  std::string all(static_cast<size_t>(total), '\0');
  CheckMpi(mpi, mpi.allgatherv(mine.data(), len, &all[0], lens.data(), displs.data(), comm),
           "MPI_Allgatherv");
  std::vector<std::string> out;
  for (int i = 0; i < size; ++i) out.emplace_back(all, displs[i], lens[i]);
  return out;
}

int EnsureMpiInitialized(bool* multiple) {
  const hvdmx_mpi_api& mpi = Mpi();
  int provided = 0, is_multiple = 0;
  CheckMpi(mpi, mpi.init_thread(&provided, &is_multiple), "MPI_Init_thread");
  *multiple = is_multiple != 0;
  return provided;
}

MpiComm::MpiComm(hvdmx_mpi_handle comm)
    : mpi_(Mpi()), comm_(mpi_.comm_null), bit_and_request_(mpi_.request_null) {
  CheckMpi(mpi_, mpi_.comm_dup(comm, &comm_), "MPI_Comm_dup");
  mpi_.comm_rank(comm_, &rank_);
  mpi_.comm_size(comm_, &size_);
}

MpiComm::~MpiComm() {
  if (comm_ != mpi_.comm_null) mpi_.comm_free(&comm_);
}

Comm::Request MpiComm::ISend(const void* buf, int64_t bytes, int peer) {
  HVDMX_CHECK(bytes <= kMaxMessageBytes, "message too large");
  hvdmx_mpi_handle req = mpi_.request_null;
  CheckMpi(mpi_, mpi_.isend(buf, static_cast<int>(bytes), peer, comm_, &req), "MPI_Isend");
  return Keep(req);
}

Comm::Request MpiComm::IRecv(void* buf, int64_t bytes, int peer) {
  HVDMX_CHECK(bytes <= kMaxMessageBytes, "message too large");
  hvdmx_mpi_handle req = mpi_.request_null;
  CheckMpi(mpi_, mpi_.irecv(buf, static_cast<int>(bytes), peer, comm_, &req), "MPI_Irecv");
  return Keep(req);
}

Comm::Request MpiComm::Keep(hvdmx_mpi_handle req) {
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
  CheckMpi(mpi_, mpi_.wait(&requests_[request]), "MPI_Wait");
  free_slots_.push_back(request);
}

void MpiComm::Bcast(void* buf, int64_t bytes, int root) {
  char* p = static_cast<char*>(buf);
  for (int64_t done = 0; done < bytes; done += kMaxMessageBytes) {
    int piece = static_cast<int>(std::min(kMaxMessageBytes, bytes - done));
    CheckMpi(mpi_, mpi_.bcast(p + done, piece, HVDMX_MPI_BYTE, root, comm_), "MPI_Bcast");
  }
}

void MpiComm::Complete(hvdmx_mpi_handle* req, const char* what) {
  if (!idle_) {
    CheckMpi(mpi_, mpi_.wait(req), what);
    return;
  }
  for (int64_t i = 0;; ++i) {
    int done = 0;
    CheckMpi(mpi_, mpi_.test(req, &done), what);
    if (done) return;
    // The request stays outstanding: MPI has no way to cancel a collective.
    if (!idle_(i)) throw CommAbandoned();
  }
}

std::vector<std::string> MpiComm::Gather(const std::string& mine, int root) {
  int my_len = static_cast<int>(mine.size());
  std::vector<int> lens(rank_ == root ? size_ : 0);
  hvdmx_mpi_handle req = mpi_.request_null;
  CheckMpi(mpi_, mpi_.igather(&my_len, 1, HVDMX_MPI_INT, lens.data(), root, comm_, &req),
           "MPI_Igather");
  Complete(&req, "MPI_Igather");
  std::vector<int> displs;
  std::string all;
  if (rank_ == root) {
    int64_t total = 0;
    displs = GatherDisplacements(lens, "a gather message", &total);
    all.resize(static_cast<size_t>(total));
  }
  CheckMpi(
      mpi_,
      mpi_.igatherv(mine.data(), my_len, &all[0], lens.data(), displs.data(), root, comm_, &req),
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
  hvdmx_mpi_handle req = mpi_.request_null;
  CheckMpi(mpi_, mpi_.ibcast(&len, 1, HVDMX_MPI_INT64, root, comm_, &req), "MPI_Ibcast");
  Complete(&req, "MPI_Ibcast");
  if (len < 0 || len > kMaxMessageBytes) {
    FailPeerInput(PeerSender::Rank(root), "a broadcast of " + std::to_string(len) +
                                              " bytes where 0 to " +
                                              std::to_string(kMaxMessageBytes) + " may be");
  }
  data->resize(static_cast<size_t>(len));
  char* p = &(*data)[0];
  for (int64_t done = 0; done < len; done += kMaxMessageBytes) {
    const int piece = static_cast<int>(std::min(kMaxMessageBytes, len - done));
    CheckMpi(mpi_, mpi_.ibcast(p + done, piece, HVDMX_MPI_BYTE, root, comm_, &req), "MPI_Ibcast");
    Complete(&req, "MPI_Ibcast");
  }
}

void MpiComm::StartBitAnd(uint64_t* words, int n) {
  HVDMX_CHECK(bit_and_request_ == mpi_.request_null, "a bit-and is already outstanding");
  CheckMpi(mpi_,
           mpi_.iallreduce(words, n, HVDMX_MPI_UINT64, HVDMX_MPI_BAND, comm_, &bit_and_request_),
           "MPI_Iallreduce");
}

bool MpiComm::TestBitAnd() {
  int done = 0;
  CheckMpi(mpi_, mpi_.test(&bit_and_request_, &done), "MPI_Test");
  return done != 0;
}

bool MpiComm::NativeAllreduce(void* buf, int64_t count, DataType dtype, ReduceOp op) {
  int type, mpi_op;
  if (!MpiType(dtype, &type) || !MpiOp(op, &mpi_op)) return false;
  const int64_t elem = static_cast<int64_t>(DataTypeSize(dtype));
  const int64_t max_count = kMaxMessageBytes / elem;
  char* p = static_cast<char*>(buf);
  for (int64_t done = 0; done < count; done += max_count) {
    int piece = static_cast<int>(std::min(max_count, count - done));
    // Nonblocking and polled: measured faster for small messages than
    // MPI_Allreduce called from a non-main thread (docs/benchmark-notes.md,
    // "Small messages: latency through the whole stack").
    hvdmx_mpi_handle req = mpi_.request_null;
    CheckMpi(mpi_, mpi_.iallreduce(p + done * elem, piece, type, mpi_op, comm_, &req),
             "MPI_Iallreduce");
    int flag = 0;
    while (!flag) mpi_.test(&req, &flag);
  }
  return true;
}

}  // namespace hvdmx
