// What the bindings of hvdmx._core (bindings.cc) and of the tests' module
// (testing/) share: the one mapping of a Status to a Python exception, and
// the request builder for collectives as the Python layer describes them.
#ifndef HVDMX_BINDINGS_SUPPORT_H_
#define HVDMX_BINDINGS_SUPPORT_H_

#include <pybind11/pybind11.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "base/common.h"
#include "negotiation/message.h"

namespace hvdmx {

// Raises a failed Status in Python: ValueError for invalid arguments,
// hvdmx.errors.PeerProtocolError for kPeerProtocol, RuntimeError otherwise.
// Call with the GIL held.
void ThrowIfError(const Status& status);

// What `init` (hvd.init's start of the job) returned, or kPeerProtocol when
// it threw PeerProtocolError (a peer that broke the protocol while the
// comms were made: its address, its handshake), so that Python raises
// hvdmx.errors.PeerProtocolError for it too; other exceptions pass.
Status InitStatus(const std::function<Status()>& init);

// Adds the Status codes (base/common.h) to module `m` as STATUS_OK,
// STATUS_MISMATCH, ...: the values that negotiate() and stop_status() return
// and hvdmx/_job.py maps to exceptions and to the exit path.
void AddStatusCodes(pybind11::module_& m);

// A collective as the Python layer describes one: dtype and reduce op
// codes, MXNet's device type (1 CPU, 2 GPU). The Python-facing functions
// take each field as a keyword argument (py::kw_only), so that every call
// names what it passes; the defaults are those of a unit that reduces
// nothing (a barrier, a join).
struct CollectiveArgs {
  CollectiveType type = CollectiveType::kAllreduce;
  std::string name;
  std::vector<int> dtypes;
  std::vector<std::vector<int64_t>> shapes;
  int op = static_cast<int>(ReduceOp::kSum);
  int root = 0;
  Scale scale;
  std::vector<int64_t> splits;
  bool sizes_only = false;
  int dev_type = 1;
  int dev_id = 0;
};

// The request for `args` from rank `rank`.
Request MakeRequest(const CollectiveArgs& args, int rank);

// A direct-read threshold (HVDMX_SHM_DIRECT_MIN_BYTES) as Python sees it:
// "auto" for kShmDirectAuto, else the byte count (-1: never).
pybind11::object DirectMinBytesValue(int64_t direct_min_bytes);

}  // namespace hvdmx

#endif  // HVDMX_BINDINGS_SUPPORT_H_
