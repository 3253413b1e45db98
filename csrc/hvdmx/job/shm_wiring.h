// The shared-memory host of a job or a process set: whether its ranks get
// one, and whether it is hierarchical (with the ring between hosts).
#ifndef HVDMX_SHM_WIRING_H_
#define HVDMX_SHM_WIRING_H_

#include <memory>

#include "comm/group.h"
#include "comm/host_map.h"
#include "config/env_config.h"
#include "shm/shm_host.h"

namespace hvdmx {

// Shared memory among the ranks of `group` (shm_host.h), for the allreduce,
// by the hosts of `hosts` (HostsForAlgorithms, a map of `group`): over all
// its ranks when they share one host (and there are several); hierarchical
// (shared memory inside each host, the ring between hosts) when
// config.hierarchical_allreduce is set or unset and every host has the same
// number of ranks, more than one. Null otherwise, when config.allreduce_algo
// is ring or mpi, or when the memory cannot be had (logged). `busy`: this
// host's ranks outnumber its CPUs (the ring's TCP spin). Collective over
// `group`.
std::unique_ptr<ShmHost> CreateHostShm(Group& group, const HostMap& hosts, const Config& config,
                                       bool busy);

}  // namespace hvdmx

#endif  // HVDMX_SHM_WIRING_H_
