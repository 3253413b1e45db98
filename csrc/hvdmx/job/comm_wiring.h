// Which comm runs over what: from the job's Group and its hosts, the
// runtime of a job or a process set, with its control comm (the
// negotiation's), its data comm (the collectives' bytes) and its shared
// memory.
//
// Note [The job's comms]
// ~~~~~~~~~~~~~~~~~~~~~~
// The transport (Config::transport, resolved here): MPI when the job was
// started with it and its ranks share one host; hvdmx's own TCP sockets
// when they span hosts (unless HVDMX_TRANSPORT says otherwise), and always
// in a job started without MPI. Then:
//   - the data comm is an MpiComm or a TcpComm over every rank, whose TCP
//     links reach the ring's neighbours and those HVDMX_ADASUM_HIERARCHICAL
//     pairs (Note [The data comm's links] in comm/p2p_comm.h);
//   - the shared memory of each host (job/shm_wiring.h), hierarchical when
//     the ranks span hosts of as many ranks each;
//   - the control comm: through shared memory (ShmControlComm) when one
//     host's shared memory spans every rank; through shared memory and the
//     hosts' leaders (HostTreeComm, Note [Negotiation across hosts] in
//     shm/host_tree_comm.h) over TCP when it is hierarchical; else an
//     MpiComm or a TcpComm over every rank alike.
// Which ranks share a host is the job's one answer (Note [One host
// split] in job/host_split.h).
//
// Threading: called at hvd.init() and when a process set is added, with the
// job's lock held; every call here is collective over its group.
#ifndef HVDMX_COMM_WIRING_H_
#define HVDMX_COMM_WIRING_H_

#include <functional>
#include <memory>
#include <vector>

#include "comm/comm.h"
#include "comm/group.h"
#include "comm/host_map.h"
#include "config/env_config.h"
#include "runtime/runtime.h"

namespace hvdmx {

// What a comm over a group carries, which decides the ranks its TCP links
// reach: the negotiation (P2PComm::NegotiationPeers) or the collectives'
// bytes (P2PComm::DataPeers; Note [The data comm's links] in p2p_comm.h).
enum class CommUse { kNegotiation, kData };

// A communicator over the ranks of `group`: MPI's (a duplicate of an
// MpiGroup's communicator), or, when config.transport is kTcp, a TcpComm
// whose addresses travel by one allgather over `group`;
// `ranks_outnumber_cpus` sets its spin (TcpOptionsFor). Its TCP links
// reach the ranks `use` names, and for kData those of `more_peers` too
// (which must be symmetric over the group). Collective over `group`; the
// transport is MPI only over an MpiGroup (StartRuntime sees to it).
std::unique_ptr<Comm> CommOver(Group& group, const Config& config, bool ranks_outnumber_cpus,
                               CommUse use, const std::vector<int>& more_peers = {});

// What a runtime negotiates over, given the comm the wiring made for it
// (the tests' seam: SetNegotiationCommWrapper in job/job.h).
using NegotiationCommWrapper =
    std::function<std::unique_ptr<ControlComm>(std::unique_ptr<ControlComm>)>;

// A started runtime over the ranks of `group`, whose hosts `hosts` (a map
// of `group`) describes, with the job's `config` (its transport resolved
// here); its negotiation comm goes through `wrap` when that is set.
// Collective over `group`.
std::shared_ptr<Runtime> StartRuntime(Group& group, const HostMap& hosts, Config config,
                                      const NegotiationCommWrapper& wrap = nullptr);

}  // namespace hvdmx

#endif  // HVDMX_COMM_WIRING_H_
