// The module _hvdmx_testing: the test suite's entry points into the core,
// built by setup.py's build_ext beside hvdmx._core into tests/ (never
// installed, never part of hvdmx). It holds its own copy of the core's code:
// what it drives (kernels, rings and whole runtimes over in-process comms,
// shared memory over plain memory) lives in this module. What a running
// job holds is in hvdmx._core, read with _core.stats(); the one exception,
// the output pool, is handed over as a capsule (_core._output_pool).
#include <pybind11/pybind11.h>

#include "testing/testing_bindings.h"

PYBIND11_MODULE(_hvdmx_testing, m) {
  m.doc() = "hvdmx's test-only entry points (tests/); not part of the hvdmx package.";
  hvdmx::DefineTestingBindings(m);
}
