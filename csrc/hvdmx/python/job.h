// The process-wide state behind the module hvdmx._core: the job's shape and
// one Runtime per process set, with init, shutdown and the process sets'
// life cycle. Errors are returned as a Status, which bindings.cc (the module)
// raises in Python; nothing here knows Python.
//
// Threading: everything here takes G().mu, and is called from Python
// threads only, without the GIL wherever MPI or a runtime may wait (the
// bindings release it).
#ifndef HVDMX_JOB_H_
#define HVDMX_JOB_H_

#include <mpi.h>

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "comm/group.h"
#include "config/env_config.h"
#include "runtime/runtime.h"

namespace hvdmx {

struct Topology {
  int rank = 0, size = 1, local_rank = 0, local_size = 1, cross_rank = 0, cross_size = 1;
};

// The process-wide state. Set 0 is the global set; every rank knows every
// set's ranks, but holds a runtime only for the sets it belongs to.
// What a runtime negotiates over, given the comm init made for it (see
// SetNegotiationCommWrapper).
using NegotiationCommWrapper = std::function<std::unique_ptr<Comm>(std::unique_ptr<Comm>)>;

struct Global {
  std::mutex mu;
  std::shared_ptr<Runtime> runtime;  // the global set's
  Topology topo;
  std::vector<std::vector<int>> hosts;  // every host's ranks, by their lowest rank
  int thread_level = 0;                 // MPI's; -1 in a job without MPI
  Config config;
  std::unique_ptr<Group> world;  // the job's ranks (an MPI duplicate, or a rendezvous)
  std::map<int, std::shared_ptr<Runtime>> sets;  // ids >= 1 this rank belongs to
  std::map<int, std::vector<int>> set_ranks;     // ids >= 1, every rank
  int next_set_id = 1;
  NegotiationCommWrapper wrap_negotiation;  // empty unless the tests' module set it
};
Global& G();

// Whether the global runtime runs. Callers hold G().mu.
bool Running();

// This rank's place in the job and MPI's thread level, from Init until this
// rank's own Shutdown(): also after a peer's shutdown (or a stall) stopped
// the runtime, as Horovod's answer until their own shutdown, so a rank
// handling that error can still say which rank it is. InvalidArgument
// otherwise.
Status JobTopology(Topology* topology, int* thread_level);
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
// InvalidArgument for a bad setting or settings that differ between ranks.
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
