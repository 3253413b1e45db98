// The MPI plugin (Note [MPI as a plugin] in mpi/mpi_plugin.h), opened
// at run time: the core links no MPI library.
//
// Threading: LoadMpiPlugin is called from Python threads (hvdmx._mpi), before
// the first init over MPI; Mpi() from any thread after it.
#ifndef HVDMX_MPI_LIBRARY_H_
#define HVDMX_MPI_LIBRARY_H_

#include <string>

#include "base/common.h"
#include "mpi/mpi_plugin.h"

namespace hvdmx {

// Opens the plugin at `path` (the one for the MPI library mpi4py loaded) and
// sets *vendor to the MPI it was built against. Once one is loaded, a call
// with the same path does nothing and another path is refused. An error
// names the path and the loader's reason (a missing libmpi.so.N, say).
Status LoadMpiPlugin(const std::string& path, std::string* vendor);

// Whether a plugin is loaded; its MPI vendor ("" when none is).
bool MpiPluginLoaded();
std::string MpiPluginVendor();

// The loaded plugin's table; throws (a std::runtime_error naming the fix)
// when none is loaded.
const hvdmx_mpi_api& Mpi();

}  // namespace hvdmx

#endif  // HVDMX_MPI_LIBRARY_H_
