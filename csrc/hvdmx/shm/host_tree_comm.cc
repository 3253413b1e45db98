// See host_tree_comm.h, Note [Negotiation across hosts].
#include "shm/host_tree_comm.h"

#include <cstring>
#include <thread>
#include <utility>

namespace hvdmx {
namespace {

// Word 0, bit 0 of the shared-memory rounds that move strings in pieces:
// set while the rank has no piece left after this one.
constexpr uint64_t kLastPiece = 1;

}  // namespace

HostTreeComm::HostTreeComm(ShmControl* shm, int local_rank, int local_size,
                           std::unique_ptr<P2PComm> leaders, int rank, int size)
    : shm_(shm),
      local_rank_(local_rank),
      local_size_(local_size),
      leaders_(std::move(leaders)),
      rank_(rank),
      size_(size) {
  HVDMX_CHECK((leaders_ != nullptr) == leader(),
              "a host's leader, and only it, has a leaders' comm");
  HVDMX_CHECK(local_size_ > 0 && size_ % local_size_ == 0,
              "every host of a host-tree comm has the same number of ranks");
  HVDMX_CHECK(!leader() || (leaders_->size() * local_size_ == size_ &&
                            (leaders_->rank() == 0) == (rank_ == 0)),
              "the leaders' comm spans the hosts, rank 0's first");
}

void HostTreeComm::set_idle(std::function<bool(int64_t)> idle) {
  if (leaders_) leaders_->set_idle(idle);
  ControlComm::set_idle(std::move(idle));
}

void HostTreeComm::AwaitShm() {
  for (int64_t i = 0; !shm_->TestBitAnd(); ++i) {
    if (idle_) {
      if (!idle_(i)) throw CommAbandoned();
    } else {
      std::this_thread::yield();
    }
  }
}

void HostTreeComm::StartBitAndCombining(uint64_t* words, int n, const std::string& payload,
                                        BitAndPartial* partial) {
  HVDMX_CHECK(phase_ == Phase::kIdle, "a bit-and is already outstanding");
  HVDMX_CHECK(payload.empty(), "the host-tree comm carries no bit-and payload");
  HVDMX_CHECK(partial == nullptr || partial->Ready(),
              "a bit-and partial needs its reduction and at most BitAndPartial::kMaxBytes");
  words_ = words;
  n_ = n;
  partial_ = partial;
  shm_->StartBitAnd(words, n, partial != nullptr ? partial->mine : std::string());  // part 1
  phase_ = Phase::kHost;
}

PeerSender HostTreeComm::LocalSender(int j) {
  return PeerSender{j, "local rank " + std::to_string(j)};
}

void HostTreeComm::CheckFrom(int j, const std::string& partial) const {
  partial_->reduction->Check(partial, LocalSender(j));
}

std::string HostTreeComm::FoldHost() {
  std::string folded;
  for (int j = 0; j < local_size_; ++j) {
    std::string theirs = j == local_rank_ ? partial_->mine : shm_->BitAndPayload(j);
    if (j != local_rank_) CheckFrom(j, theirs);
    folded =
        j == 0 ? std::move(theirs) : partial_->reduction->Combine(folded, theirs, LocalSender(j));
  }
  return folded;
}

void HostTreeComm::StartResult() {
  if (leader()) {
    const uint64_t hops = static_cast<uint64_t>(hops_);
    std::string payload(reinterpret_cast<const char*>(&hops), 8);
    if (partial_ != nullptr) payload += partial_->combined;
    shm_->StartBitAnd(words_, n_, payload);
  } else {
    ones_.assign(n_, ~uint64_t{0});
    shm_->StartBitAnd(ones_.data(), n_);
  }
  phase_ = Phase::kResult;
}

bool HostTreeComm::TestBitAnd() {
  HVDMX_CHECK(phase_ != Phase::kIdle, "no bit-and is outstanding");
  if (phase_ == Phase::kHost) {
    if (!shm_->TestBitAnd()) return false;
    if (size_ == local_size_) {  // one host: part 1 was the whole AND
      // Every rank folds the host's partials alike.
      if (partial_ != nullptr) partial_->combined = FoldHost();
      hops_ = 0;
      phase_ = Phase::kIdle;
      return true;
    }
    if (leader() && partial_ != nullptr) partial_->combined = FoldHost();
    if (leader() && leaders_->size() > 1) {
      if (partial_ != nullptr) {
        leaders_partial_.mine = std::move(partial_->combined);
        leaders_partial_.reduction = partial_->reduction;
        leaders_->StartBitAndCombining(words_, n_, "", &leaders_partial_);  // part 2
      } else {
        leaders_->StartBitAnd(words_, n_);  // part 2
      }
      phase_ = Phase::kLeaders;
      in_network_ = true;
    } else {
      hops_ = 0;
      StartResult();
    }
  }
  if (phase_ == Phase::kLeaders) {
    if (!leaders_->TestBitAnd()) return false;
    in_network_ = false;
    hops_ = leaders_->last_bit_and_hops();
    if (partial_ != nullptr) partial_->combined = std::move(leaders_partial_.combined);
    StartResult();
  }
  if (!shm_->TestBitAnd()) return false;  // part 3
  if (!leader()) {
    std::memcpy(words_, ones_.data(), static_cast<size_t>(n_) * 8);
    // The leader's hops, then the combination: input, as any peer's.
    const std::string got = shm_->BitAndPayload(0);
    PeerInput in(got, LocalSender(0), "a bit-and result");
    hops_ = static_cast<int>(in.Int64In("hops", 0, size_ - 1));
    if (partial_ != nullptr) {
      partial_->combined = in.Bytes(in.remaining(), "partial");
      CheckFrom(0, partial_->combined);
    }
  }
  phase_ = Phase::kIdle;
  return true;
}

std::vector<std::string> HostTreeComm::Gather(const std::string& mine, int root) {
  HVDMX_CHECK(root == 0 && phase_ == Phase::kIdle, "the host-tree comm gathers to rank 0");
  // The host's strings to its leader, a mailbox at a time; each rank's
  // first piece starts with its global rank.
  std::string rest = std::string(reinterpret_cast<const char*>(&rank_), 4) + mine;
  std::vector<std::string> host(leader() ? local_size_ : 0);
  for (;;) {
    const size_t take = std::min<size_t>(rest.size(), ShmControl::kMaxPayloadBytes);
    uint64_t word = take == rest.size() ? ~uint64_t{0} : ~kLastPiece;
    shm_->StartBitAnd(&word, 1, rest.substr(0, take));
    rest.erase(0, take);
    AwaitShm();
    if (leader()) {
      for (int j = 0; j < local_size_; ++j) host[j] += shm_->BitAndPayload(j);
    }
    if (word & kLastPiece) break;
  }
  if (!leader()) return {};
  std::string bundle;
  for (int j = 0; j < local_size_; ++j) {
    PeerInput in(host[j], LocalSender(j), "a gather");
    const int64_t r = in.Int32In("rank", 0, size_ - 1);
    AppendGatherRecord(static_cast<int>(r), in.Bytes(in.remaining(), "string"), &bundle);
  }
  in_network_ = true;
  std::vector<std::string> bundles = leaders_->Gather(bundle, 0);
  in_network_ = false;
  if (rank_ != 0) return {};
  std::vector<std::string> out(size_);
  std::vector<bool> seen(size_, false);
  for (int leader = 0; leader < leaders_->size(); ++leader) {
    std::vector<std::pair<uint32_t, std::string>> records;
    ParseGatherRecords(bundles[leader], leaders_->Sender(leader), size_, &records);
    if (static_cast<int>(records.size()) != local_size_) {
      leaders_->FailProtocol(leader, "a host's gather of " + std::to_string(records.size()) +
                                         " records where its host has " +
                                         std::to_string(local_size_) + " ranks");
    }
    for (auto& record : records) {
      const uint32_t r = record.first;
      if (seen[r]) {
        leaders_->FailProtocol(
            leader, "a host's gather record for rank " + std::to_string(r) + ", which came twice");
      }
      seen[r] = true;
      out[r] = std::move(record.second);
    }
  }
  return out;
}

void HostTreeComm::BcastString(std::string* data, int root) {
  HVDMX_CHECK(root == 0 && phase_ == Phase::kIdle, "the host-tree comm broadcasts from rank 0");
  if (leader()) {
    in_network_ = true;
    leaders_->BcastString(data, 0);
    in_network_ = false;
  } else {
    data->clear();
  }
  // From the leader to its host, a mailbox at a time.
  for (size_t at = 0;;) {
    const size_t take =
        leader() ? std::min<size_t>(data->size() - at, ShmControl::kMaxPayloadBytes) : 0;
    uint64_t word = leader() && at + take < data->size() ? ~kLastPiece : ~uint64_t{0};
    shm_->StartBitAnd(&word, 1, leader() ? data->substr(at, take) : std::string());
    at += take;
    AwaitShm();
    if (!leader()) *data += shm_->BitAndPayload(0);
    if (word & kLastPiece) break;
  }
}

}  // namespace hvdmx
