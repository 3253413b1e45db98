// The job, as hvd.init() builds it: the job's shape and one Runtime per
// process set, with init, shutdown and the process sets' life cycle. How
// its comms are wired is comm_wiring.h's, which ranks share a host
// host_split.h's, the key secret_key.h's. Errors are returned as a Status,
// which the bindings (python/bindings.cc, the module hvdmx._core) raise in
// Python; nothing here knows Python.
//
// Threading: everything here takes the job's lock, and is called from
// Python threads only, without the GIL wherever MPI or a runtime may wait
// (the bindings release it).
#ifndef HVDMX_JOB_H_
#define HVDMX_JOB_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "base/common.h"
#include "comm/group.h"
#include "job/comm_wiring.h"
#include "job/host_split.h"
#include "runtime/runtime.h"

namespace hvdmx {

// Whether the global runtime runs: false before init, after shutdown, and
// again once any rank has shut the job down (see Note [Shutdown]).
bool JobRunning();

// Why the global runtime stopped when this rank's shutdown did not stop it
// alone (Runtime::stop_status); Ok while it runs, before init and after
// this rank's shutdown.
Status JobStopStatus();

// HVDMX_STALL_SHUTDOWN_TIME_SECONDS as the last init read it (0: off, and
// before the first init).
double JobStallShutdownSeconds();

// The ids of the process sets every rank knows, 0 (the global set) first.
std::vector<int> JobProcessSetIds();

// This rank's place in the job and whether MPI provides
// MPI_THREAD_MULTIPLE (false in a job without MPI), from Init until this
// rank's own Shutdown(): also after a peer's shutdown (or a stall) stopped
// the runtime, as Horovod's answer until their own shutdown, so a rank
// handling that error can still say which rank it is. InvalidArgument
// otherwise.
Status JobTopology(Topology* topology, bool* thread_multiple);
// Every host's ranks (hosts in the order of their lowest rank), known from
// init as JobTopology's answer is.
Status JobHosts(std::vector<std::vector<int>>* hosts);

// The runtime of process set `set_id` (0: the global set); Shutdown before
// init (and after shutdown), InvalidArgument for a set this rank is not in.
Status RunningRuntime(int set_id, std::shared_ptr<Runtime>* runtime);

// True when no runtime (the global one and this rank's sets) has a
// collective inside MXNet's engine or waiting for the other ranks: waiting
// for MXNet's engine to finish then waits for nothing from other ranks.
bool AllIdle();

// Collective over the communicator at `comm_address` (0: MPI_COMM_WORLD),
// which the caller keeps alive; a second call while running does nothing.
// InvalidArgument for a bad setting or settings that differ between ranks,
// and before the MPI plugin is loaded (comm/mpi_library.h).
Status Init(uintptr_t comm_address);
// The same over `world`, in a job started without MPI (hvdmxrun --no-mpi:
// the launcher's rendezvous), which never calls MPI. Collective over `world`.
Status InitOver(std::unique_ptr<Group> world);

// A seam for the test suite's own module (tests/_hvdmx_testing), which hvdmx
// itself never sets: every runtime this process starts after the call
// negotiates over wrap(the comm init made for it) instead. The tests wrap
// one rank's comm of a real job across hosts so that it sends its peers bad
// negotiation bytes (tests/test_peer_input_tcp.py). An empty `wrap` undoes it.
void SetNegotiationCommWrapper(NegotiationCommWrapper wrap);
void Shutdown();

// Collective over the whole job; sets *id to the new set's id. With
// `same_everywhere`, every rank passes the same sorted, distinct ranks
// (checked here, so a mismatch is an error everywhere, not a hang).
// Without, the set is a partition made from a split communicator: each rank
// passes its own group (checked by the caller) and every group becomes a set
// of its own under the one id.
Status AddProcessSet(const std::vector<int>& ranks, bool same_everywhere, int* id);

// Collective over the set's ranks.
Status RemoveProcessSet(int id);

}  // namespace hvdmx

#endif  // HVDMX_JOB_H_
