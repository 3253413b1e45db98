// Which ranks share a host, found once at hvd.init() and handed to
// everything that needs it (Note [One host split]).
//
// Note [One host split]
// ~~~~~~~~~~~~~~~~~~~~~
// hvd.init() asks once which ranks of the job share a host: the job's Group
// splits by host (MPI's MPI_COMM_TYPE_SHARED, or the host name in a job
// started without MPI: comm/group.h) and the ranks allgather the lowest rank
// of each one's host. The HostMap this makes (comm/host_map.h) is then the
// one answer for the job's topology (hvd.local_rank() and friends), the
// choice of transport (TCP when the ranks span hosts), whether ranks
// outnumber the CPUs, the CPU binding, the negotiation's host tree, the
// shared memory and the hierarchical Adasum. A process set's map is the
// job's, restricted to its ranks (no second split).
//
// HVDMX_TESTING_RANKS_PER_HOST (docs/env.md) pretends that runs of k ranks
// are hosts for the shared memory and the hierarchical algorithms only
// (HostsForAlgorithms); the topology, the transport and the CPU binding
// keep the real hosts.
#ifndef HVDMX_HOST_SPLIT_H_
#define HVDMX_HOST_SPLIT_H_

#include <memory>
#include <vector>

#include "comm/group.h"
#include "comm/host_map.h"
#include "config/env_config.h"

namespace hvdmx {

// A rank's place in the job, as hvd.rank(), hvd.local_rank() and
// hvd.cross_rank() report it.
struct Topology {
  int rank = 0, size = 1, local_rank = 0, local_size = 1, cross_rank = 0, cross_size = 1;
};

// Which ranks of `group` share a host. Collective over `group`. Throws
// std::runtime_error when a rank sent a host that cannot be (the bytes may
// have crossed the network through a rendezvous).
HostMap FindHosts(Group& group);

// The map of `sub`, a group made of some of the ranks of the group `hosts`
// describes, in which this rank is `rank`. Collective over `sub` (one
// allgather of the ranks' places in the whole).
HostMap HostsOfSubgroup(Group& sub, const HostMap& hosts, int rank);

// `rank`'s place in the group `hosts` describes.
Topology TopologyOf(const HostMap& hosts, int rank);

// The hosts the shared memory and the hierarchical algorithms treat as
// such: `hosts`, or under HVDMX_TESTING_RANKS_PER_HOST runs of that many
// consecutive ranks.
HostMap HostsForAlgorithms(const HostMap& hosts, const Config& config);

// The ranks of `group` on this rank's host in `hosts` (a map of `group`), in
// the group's order. Collective over `group`.
std::unique_ptr<Group> SplitByHostMap(Group& group, const HostMap& hosts);

// Whether this host's ranks in `hosts` outnumber the CPUs this process may
// run on.
bool HostRanksOutnumberCpus(const HostMap& hosts, int rank);

}  // namespace hvdmx

#endif  // HVDMX_HOST_SPLIT_H_
