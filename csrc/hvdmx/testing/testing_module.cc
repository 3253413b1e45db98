// The module _hvdmx_testing: the test suite's entry points into the core,
// built by setup.py's build_ext beside hvdmx._core into tests/ (never
// installed, never part of hvdmx). It holds no code of the core's: it links
// the core library hvdmx/libhvdmx_core.so, as hvdmx._core does, so the
// process has one core and one of each of its singletons (the job, the
// output pool, the timeline), which both modules act on
// (tests/test_core_ships_no_tests.py checks it). What a running job has
// done is read from the product, with _core.stats().
#include <pybind11/pybind11.h>

#include "testing/testing_bindings.h"

PYBIND11_MODULE(_hvdmx_testing, m) {
  m.doc() = "hvdmx's test-only entry points (tests/); not part of the hvdmx package.";
  hvdmx::DefineTestingBindings(m);
}
