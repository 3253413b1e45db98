// The test suite's own module, _hvdmx_testing (testing_module.cc): the
// functions its two binding files define, and what they share.
#ifndef HVDMX_TESTING_BINDINGS_H_
#define HVDMX_TESTING_BINDINGS_H_

#include <pybind11/pybind11.h>

#include <memory>
#include <string>
#include <vector>

#include "base/common.h"
#include "python/bindings_support.h"

namespace hvdmx {

// A dtype code from a test as a DataType; ValueError if unsupported.
DataType CheckedType(int code);

// Plain memory laid out as one host's shared-memory segment, for ranks
// that are threads of this process: `ranks` zeroed regions of
// ShmRegion::RegionBytes(chunk_bytes), the first on a page as a real
// mapping's is (testing_shm_bindings.cc).
struct PlainShmRegions {
  PlainShmRegions(int ranks, int64_t chunk_bytes);
  std::shared_ptr<std::vector<char>> memory;  // owns the regions
  std::vector<char*> regions;
};

// Adds the kernels', ring's, configuration's, autotuner's and output
// pool's functions and LocalJob to the module (testing_bindings.cc).
void DefineTestingBindings(pybind11::module_& m);

// Adds the shared-memory collectives' functions (testing_shm_bindings.cc).
void DefineTestingShmBindings(pybind11::module_& m);
// testing_tcp_bindings.cc: TcpComm with threads as ranks.
void DefineTestingTcpBindings(pybind11::module_& m);

}  // namespace hvdmx

#endif  // HVDMX_TESTING_BINDINGS_H_
