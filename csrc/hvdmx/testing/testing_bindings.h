// The test suite's own module, _hvdmx_testing (testing_module.cc): the
// functions its two binding files define, and what they share.
#ifndef HVDMX_TESTING_BINDINGS_H_
#define HVDMX_TESTING_BINDINGS_H_

#include <pybind11/pybind11.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "base/common.h"
#include "comm/comm.h"
#include "python/bindings_support.h"
#include "shm/plain_regions.h"

namespace hvdmx {

// A dtype code from a test as a DataType; ValueError if unsupported.
DataType CheckedType(int code);

// Adds the kernels', ring's, configuration's, autotuner's and output
// pool's functions and LocalJob to the module (testing_bindings.cc).
void DefineTestingBindings(pybind11::module_& m);

// Adds the shared-memory collectives' functions (testing_shm_bindings.cc).
void DefineTestingShmBindings(pybind11::module_& m);
// testing_tcp_bindings.cc: TcpComm with threads as ranks.
void DefineTestingTcpBindings(pybind11::module_& m);
// testing_comm_bindings.cc: the collectives over LocalComm.
void DefineTestingCommBindings(pybind11::module_& m);
// testing_negotiation_bindings.cc: the negotiation's wire format parsed in
// process, and a round with a rank that breaks the protocol.
void DefineTestingNegotiationBindings(pybind11::module_& m);
// testing_liar_bindings.cc: one rank of a real job that sends its peers
// bad negotiation bytes.
void DefineTestingLiarBindings(pybind11::module_& m);

// Runs body(rank, &result) on n threads (the GIL released); returns each
// rank's result with "error": what it threw ("" if nothing).
std::vector<pybind11::dict> OnThreads(int n, const std::function<void(int, pybind11::dict*)>& body);
// Every collective of the Comm interface on `comm`, from every root, as
// tests/comm_checks.py expects them: three bit-ands with payloads, Gather,
// BcastString and Bcast (`count` ints) from each root, and the exchange and
// ring allreduces of `count` floats. Called by every rank, with the GIL
// released; puts what this rank got in *result.
void RecordCollectives(Comm& comm, int64_t count, int64_t segment_bytes, pybind11::dict* result);
// The collectives that carry data, as tests/test_data_links.py expects
// them: an alltoall of matrix[i * n + j] bytes from i to j (twice), Bruck's
// allgather of `count` bytes a rank, the ring's allgather and
// reduce-scatter over uneven chunks, Adasum over every rank and, given one
// host key a rank, the hierarchical Adasum. Called like RecordCollectives.
void RecordDataCollectives(Comm& comm, const std::vector<int64_t>& matrix, int64_t count,
                           const std::vector<std::string>& host_keys, pybind11::dict* result);

}  // namespace hvdmx

#endif  // HVDMX_TESTING_BINDINGS_H_
