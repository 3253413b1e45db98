// The control communicator of a job whose ranks all share one host: the
// negotiation's bit-and, its payloads and its string broadcasts go through
// the ranks' shared-memory control blocks (ShmControl) instead of MPI;
// the gather, and strings too long for a mailbox, go to `inner`.
// Through MPI, the bit-and and the coordinator's gather and broadcast were
// most of a small collective's latency (docs/benchmark-notes.md,
// "Negotiation through shared memory").
#ifndef HVDMX_SHM_CONTROL_COMM_H_
#define HVDMX_SHM_CONTROL_COMM_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/comm.h"
#include "shm/shm_control.h"
#include "shm/shm_host.h"

namespace hvdmx {

class ShmControlComm : public ControlComm {
 public:
  // `shm` spans the same ranks as `inner` (`size` of them, this rank being
  // `rank`), in the same order, and outlives this comm.
  ShmControlComm(std::unique_ptr<ControlComm> inner, ShmControl* shm, int rank, int size)
      : inner_(std::move(inner)), shm_(shm) {
    HVDMX_CHECK(size == inner_->size() && rank == inner_->rank(),
                "the shared-memory control comm must span the control comm's ranks");
  }
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::vector<std::string> Gather(const std::string& mine, int root) override {
    return inner_->Gather(mine, root);
  }
  void BcastString(std::string* data, int root) override {
    if (!shm_->BcastString(data, root)) inner_->BcastString(data, root);
  }
  void set_idle(std::function<bool(int64_t)> idle) override { inner_->set_idle(std::move(idle)); }
  void StartBitAnd(uint64_t* words, int n) override { shm_->StartBitAnd(words, n); }
  bool TestBitAnd() override { return shm_->TestBitAnd(); }
  int64_t BitAndPayloadCapacity() const override { return ShmControl::kMaxPayloadBytes; }
  void StartBitAndWithPayload(uint64_t* words, int n, const std::string& payload) override {
    shm_->StartBitAnd(words, n, payload);
  }
  std::string BitAndPayload(int rank) const override { return shm_->BitAndPayload(rank); }

 private:
  std::unique_ptr<ControlComm> inner_;
  ShmControl* shm_;
};

// `control` through `shm`'s control blocks (a ShmControlComm) when `shm`
// spans all of its ranks, more than one, on one host and its mailboxes hold
// a round's `bit_words` words; else `control` as it is.
inline std::unique_ptr<ControlComm> ControlThroughShm(std::unique_ptr<ControlComm> control,
                                                      ShmHost* shm, int64_t bit_words) {
  if (shm == nullptr || shm->hierarchical() || shm->size() != control->size() ||
      control->size() < 2 || bit_words > ShmControl::kMaxBitAndWords) {
    return control;
  }
  const int rank = shm->rank(), size = shm->size();
  return std::make_unique<ShmControlComm>(std::move(control), &shm->control(), rank, size);
}

}  // namespace hvdmx

#endif  // HVDMX_SHM_CONTROL_COMM_H_
