// Entry point for tests/test_peer_input_tcp.py: one rank of a real job (a
// process of its own, on a test host of its own, hvd.init() over TCP)
// that sends its peers bad negotiation bytes. lie_in_negotiation() wraps
// the negotiation comm of the runtime that this process's next hvd.init()
// starts (SetNegotiationCommWrapper in job/job.h) in a LyingComm, which
// passes everything on to the real comm except, once, the bytes the lie
// replaces. The runtime, its controller and every peer are the product's.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "comm/comm.h"
#include "comm/group.h"
#include "job/job.h"
#include "job/secret_key.h"
#include "python/bindings_support.h"
#include "testing/testing_bindings.h"

namespace py = pybind11;

namespace hvdmx {
namespace {

// Word 0's flags of a round's bit-and (Note [Negotiation round] in
// negotiation/controller.h).
constexpr uint64_t kNothingForCoordinator = 1;
constexpr uint64_t kSentWithBitAnd = 4;

// What a LyingComm replaces, once, in the first round in which its rank
// has requests for the coordinator (or, for kResponses, answers them):
enum class Lie {
  kPayload,    // its request list, sent with the bit-and: with `lie`
  kGather,     // the same, sent by the gather instead: with `lie`
  kFrame,      // its whole gather message, records and all: with `lie`
  kResponses,  // rank 0: the responses it broadcasts: with `lie`
  kBitAnd,     // its bit-and message to the ranks `to`: with `lie`; to the
               // others an honest one without requests, after which it
               // takes part in nothing more (the others may wait for it)
};

Lie LieFrom(const std::string& how) {
  if (how == "payload") return Lie::kPayload;
  if (how == "gather") return Lie::kGather;
  if (how == "frame") return Lie::kFrame;
  if (how == "responses") return Lie::kResponses;
  if (how == "bitand") return Lie::kBitAnd;
  throw py::value_error("how: 'payload', 'gather', 'frame', 'responses' or 'bitand', not '" + how +
                        "'");
}

// Its kFrame and kBitAnd lies are raw messages on the negotiation comm's
// own links: that comm must be a transport's (a TcpComm over the ranks, as
// in the test's job of one rank a host), which serves point-to-point too.
class LyingComm : public ControlComm {
 public:
  LyingComm(std::unique_ptr<ControlComm> inner, Lie how, std::string lie, std::set<int> to)
      : inner_(std::move(inner)),
        links_(dynamic_cast<DataComm*>(inner_.get())),
        how_(how),
        lie_(std::move(lie)),
        to_(std::move(to)) {
    if ((how_ == Lie::kFrame || how_ == Lie::kBitAnd) && links_ == nullptr) {
      throw std::logic_error(
          "hvdmx testing: lie_in_negotiation('frame' or 'bitand') needs a "
          "negotiation comm with point-to-point messages (TCP, one rank a "
          "host)");
    }
  }

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }

  std::vector<std::string> Gather(const std::string& mine, int root) override {
    if (forced_gather_ && how_ == Lie::kGather) {
      forced_gather_ = false;
      return inner_->Gather(lie_, root);
    }
    if (forced_gather_ && how_ == Lie::kFrame) {
      // In place of the gather: what this rank's parent reads as its
      // gather message (rank 0 must be the parent: the test's liars are
      // ranks 1 and 2 of 3).
      forced_gather_ = false;
      links_->Wait(links_->ISend(lie_.data(), static_cast<int64_t>(lie_.size()), root));
      return {};
    }
    return inner_->Gather(mine, root);
  }

  void BcastString(std::string* data, int root) override {
    if (!lied_ && how_ == Lie::kResponses && rank() == root) {
      lied_ = true;
      *data = lie_;
    }
    inner_->BcastString(data, root);
  }

  void set_idle(std::function<bool(int64_t)> idle) override { inner_->set_idle(std::move(idle)); }
  bool WakesOnArrival() const override { return inner_->WakesOnArrival(); }
  void AwaitArrival(int64_t waited_micros) override { inner_->AwaitArrival(waited_micros); }
  void ReportStop(const std::string& finding) override { inner_->ReportStop(finding); }

  void StartBitAnd(uint64_t* words, int n) override { StartBitAndCombining(words, n, "", nullptr); }
  bool TestBitAnd() override { return silent_ ? false : inner_->TestBitAnd(); }
  int64_t BitAndPayloadCapacity() const override { return inner_->BitAndPayloadCapacity(); }
  void StartBitAndWithPayload(uint64_t* words, int n, const std::string& payload) override {
    StartBitAndCombining(words, n, payload, nullptr);
  }
  std::string BitAndPayload(int rank) const override { return inner_->BitAndPayload(rank); }
  bool CombinesPartials() const override { return inner_->CombinesPartials(); }
  void StartBitAndCombining(uint64_t* words, int n, const std::string& payload,
                            BitAndPartial* partial) override {
    std::string sent = payload;
    const bool has_requests = (words[0] & kNothingForCoordinator) == 0;
    if (!lied_ && has_requests && how_ != Lie::kResponses) {
      lied_ = true;
      if (how_ == Lie::kPayload && sent.empty()) {
        lied_ = false;  // its requests go by the gather this round: lie in a later one
      } else if (how_ == Lie::kPayload) {
        sent = lie_;
      } else if (how_ == Lie::kBitAnd) {
        SendBitAndLie(words, n);
        return;
      } else {
        // kGather and kFrame: the round gathers (Note [Requests with the
        // bit-and]), and Gather lies.
        words[0] &= ~kSentWithBitAnd;
        sent.clear();
        forced_gather_ = true;
      }
    }
    if (partial != nullptr) {
      inner_->StartBitAndCombining(words, n, sent, partial);
    } else {
      inner_->StartBitAndWithPayload(words, n, sent);
    }
  }

 private:
  // A direct bit-and's message (Note [The bit-and over point-to-point] in
  // comm/p2p_collectives.cc): the words, then the partial's length and
  // the partial (none here). The honest one says that this rank has
  // requests and sends none with the bit-and, so the coordinator waits for
  // its gather, which never comes.
  void SendBitAndLie(const uint64_t* words, int n) {
    std::string honest(reinterpret_cast<const char*>(words), static_cast<size_t>(n) * 8);
    uint64_t flags = words[0] & ~kSentWithBitAnd;
    std::memcpy(&honest[0], &flags, 8);
    honest.append(8, '\0');
    for (int peer = 0; peer < size(); ++peer) {
      if (peer == rank()) continue;
      const std::string& message = to_.count(peer) ? lie_ : honest;
      links_->Wait(links_->ISend(message.data(), static_cast<int64_t>(message.size()), peer));
    }
    silent_ = true;
  }

  std::unique_ptr<ControlComm> inner_;
  DataComm* links_;  // inner_ itself, where it has point-to-point messages
  Lie how_;
  std::string lie_;
  std::set<int> to_;
  bool lied_ = false;
  bool forced_gather_ = false;  // this round's requests go by the gather, which lies
  bool silent_ = false;         // kBitAnd: no bit-and of this rank's ever completes
};

// Wraps the negotiation comm of every runtime this process starts from
// now on (see LyingComm and Lie).
void LieInNegotiation(const std::string& how, const py::bytes& lie_bytes,
                      const std::vector<int>& to) {
  const Lie lie = LieFrom(how);
  const std::string bytes = lie_bytes;
  const std::set<int> peers(to.begin(), to.end());
  if (lie != Lie::kBitAnd && !peers.empty()) throw py::value_error("to: only for 'bitand'");
  SetNegotiationCommWrapper([lie, bytes, peers](std::unique_ptr<ControlComm> inner) {
    return std::unique_ptr<ControlComm>(new LyingComm(std::move(inner), lie, bytes, peers));
  });
}

// Rank 1 of a group of 2 whose rank 0 says it has no key either, then
// broadcasts `key` as the one it made: what AgreeOnSecretKey says.
class KeyLiarGroup : public Group {
 public:
  explicit KeyLiarGroup(std::string key) : key_(std::move(key)) {}
  int rank() const override { return 1; }
  int size() const override { return 2; }
  std::vector<std::string> Allgather(const std::string& mine) override {
    // The first call asks who has a key: rank 0's answer is this rank's.
    return {calls_++ == 0 ? mine : key_, mine};
  }
  std::unique_ptr<Group> Split(int, int) override {
    throw std::logic_error("hvdmx testing: KeyLiarGroup does not split");
  }
  bool private_channel() const override { return true; }

 private:
  std::string key_;
  int calls_ = 0;
};

py::tuple AgreeOnKeyFromLiar(const py::bytes& key) {
  KeyLiarGroup group(key);
  std::string agreed;
  const Status status = AgreeOnSecretKey(group, &agreed);
  return py::make_tuple(static_cast<int>(status.code()), status.message(), py::bytes(agreed));
}

}  // namespace

void DefineTestingLiarBindings(py::module_& m) {
  m.def("lie_in_negotiation", &LieInNegotiation, py::arg("how"), py::arg("lie"),
        py::arg("to") = std::vector<int>());
  m.def("stop_lying", [] { SetNegotiationCommWrapper(nullptr); });
  // (code, message, key): rank 1's AgreeOnSecretKey when rank 0 sends `key`.
  m.def("agree_on_key_from_liar", &AgreeOnKeyFromLiar, py::arg("key"));
  // As hvd.init() raises it: AgreeOnSecretKey's status through
  // InitStatus and ThrowIfError (python/bindings_support.h).
  m.def("init_key_from_liar", [](const py::bytes& key) {
    const std::string bytes = key;
    const Status status = InitStatus([&] {
      KeyLiarGroup group(bytes);
      std::string agreed;
      return AgreeOnSecretKey(group, &agreed);
    });
    ThrowIfError(status);
  });
}

}  // namespace hvdmx
