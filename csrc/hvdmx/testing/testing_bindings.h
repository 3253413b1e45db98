// The test suite's entry points into the core (testing_bindings.cc), and
// what both binding files share: the Status-to-exception mapping and the
// request builder.
#ifndef HVDMX_TESTING_BINDINGS_H_
#define HVDMX_TESTING_BINDINGS_H_

#include <pybind11/pybind11.h>

#include <memory>
#include <string>
#include <vector>

#include "base/common.h"
#include "negotiation/message.h"

namespace hvdmx {

// Raises a failed Status in Python: ValueError for invalid arguments,
// RuntimeError otherwise.
void ThrowIfError(const Status& status);

// A request as the Python layer describes one (dtype codes, reduce op code,
// device type 2 = GPU), from rank `rank`.
Request MakeRequest(CollectiveType type, const std::string& name,
                    const std::vector<int>& dtypes,
                    const std::vector<std::vector<int64_t>>& shapes, int op, int root,
                    double prescale, double postscale, int dev_type, int dev_id, int rank);

// A dtype code from a test as a DataType; ValueError if unsupported.
DataType CheckedType(int code);

// A direct-read threshold (HVDMX_SHM_DIRECT_MIN_BYTES) as the tests see it:
// "auto" for kShmDirectAuto, else the byte count (-1: never).
pybind11::object DirectMinBytesValue(int64_t direct_min_bytes);

// Plain memory laid out as one host's shared-memory segment, for ranks
// that are threads of this process: `ranks` zeroed regions of
// ShmAllreduce::RegionBytes(chunk_bytes), the first on a page as a real
// mapping's is (testing_shm_bindings.cc).
struct PlainShmRegions {
  PlainShmRegions(int ranks, int64_t chunk_bytes);
  std::shared_ptr<std::vector<char>> memory;  // owns the regions
  std::vector<char*> regions;
};

// Adds the _testing_* functions and _TestingLocalJob to the module.
void DefineTestingBindings(pybind11::module_& m);

// Adds the _testing_shm_* functions (testing_shm_bindings.cc).
void DefineTestingShmBindings(pybind11::module_& m);

}  // namespace hvdmx

#endif  // HVDMX_TESTING_BINDINGS_H_
