#include "comm/mpi_library.h"

#include <dlfcn.h>

#include <atomic>
#include <mutex>
#include <stdexcept>
#include <string>

namespace hvdmx {
namespace {

struct Plugin {
  std::mutex mu;
  std::string path;
  // Set once, under mu; read without it on every MPI call.
  std::atomic<const hvdmx_mpi_api*> api{nullptr};
};

Plugin& P() {
  static Plugin* p = new Plugin();  // never destroyed: MPI may be called at exit
  return *p;
}

}  // namespace

Status LoadMpiPlugin(const std::string& path, std::string* vendor) {
  std::lock_guard<std::mutex> lock(P().mu);
  if (P().api.load() != nullptr) {
    if (path != P().path) {
      return Status::InvalidArgument("hvdmx: the MPI plugin " + P().path +
                                     " is loaded already; cannot load " + path + " beside it");
    }
    *vendor = P().api.load()->vendor;
    return Status::Ok();
  }
  // RTLD_LOCAL: the plugin's one symbol stays out of the global scope. Its
  // NEEDED libmpi.so.N binds to the MPI library mpi4py loaded (same soname).
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    return Status::InvalidArgument("hvdmx: cannot load the MPI plugin " + path + " (" +
                                   std::string(why != nullptr ? why : "no reason given") + ")");
  }
  using Entry = const hvdmx_mpi_api* (*)();
  auto entry = reinterpret_cast<Entry>(dlsym(handle, "hvdmx_mpi_plugin"));
  const hvdmx_mpi_api* api = entry != nullptr ? entry() : nullptr;
  if (api == nullptr || api->abi != HVDMX_MPI_PLUGIN_ABI) {
    dlclose(handle);
    return Status::InvalidArgument(
        "hvdmx: " + path + " is not an MPI plugin of this hvdmx (interface " +
        std::to_string(HVDMX_MPI_PLUGIN_ABI) + "); reinstall hvdmx, or rebuild it");
  }
  // The handle is never closed: MPI is used until the process exits.
  P().path = path;
  P().api.store(api, std::memory_order_release);
  *vendor = api->vendor;
  return Status::Ok();
}

bool MpiPluginLoaded() { return P().api.load() != nullptr; }

std::string MpiPluginVendor() {
  const hvdmx_mpi_api* api = P().api.load();
  return api != nullptr ? api->vendor : "";
}

const hvdmx_mpi_api& Mpi() {
  const hvdmx_mpi_api* api = P().api.load(std::memory_order_acquire);
  if (api == nullptr) {
    throw std::runtime_error(
        "hvdmx: MPI is not loaded (hvdmx._mpi.load_mpi loads it before the first init over "
        "MPI); install an MPI (pip install mpich mpi4py), or start the job with hvdmxrun "
        "--no-mpi");
  }
  return *api;
}

}  // namespace hvdmx
