// What the bindings of hvdmx._core (bindings.cc) and of the tests' module
// (testing/) share: the one mapping of a Status to a Python exception, and
// the request builder for collectives as the Python layer describes them.
#ifndef HVDMX_BINDINGS_SUPPORT_H_
#define HVDMX_BINDINGS_SUPPORT_H_

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <vector>

#include "base/common.h"
#include "negotiation/message.h"

namespace hvdmx {

// Raises a failed Status in Python: ValueError for invalid arguments,
// RuntimeError otherwise. Call with the GIL held.
void ThrowIfError(const Status& status);

// Adds the Status codes (base/common.h) to module `m` as STATUS_OK,
// STATUS_MISMATCH, ...: the values that negotiate() and stop_status() return
// and hvdmx/_job.py maps to exceptions and to the exit path.
void AddStatusCodes(pybind11::module_& m);

// A request as the Python layer describes one (dtype codes, reduce op code,
// device type 2 = GPU), from rank `rank`.
Request MakeRequest(CollectiveType type, const std::string& name, const std::vector<int>& dtypes,
                    const std::vector<std::vector<int64_t>>& shapes, int op, int root,
                    double prescale, double postscale, int dev_type, int dev_id, int rank);

// A direct-read threshold (HVDMX_SHM_DIRECT_MIN_BYTES) as Python sees it:
// "auto" for kShmDirectAuto, else the byte count (-1: never).
pybind11::object DirectMinBytesValue(int64_t direct_min_bytes);

}  // namespace hvdmx

#endif  // HVDMX_BINDINGS_SUPPORT_H_
