// Binding a rank's threads to one CPU when the ranks of a host outnumber its
// CPUs (or match them).
//
// Note [Binding a rank's threads to one CPU]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A collective hands work between three threads of a rank: the Python
// thread submits it, hvdmx's background thread negotiates and moves the
// bytes, and one of MXNet's engine workers wakes the reader (MXNet's
// WaitForVar runs there). Each hand-off to a thread that sleeps on another
// CPU costs a wake-up across CPUs, which on a virtual machine takes tens of
// microseconds. With two ranks on two CPUs, where each rank's threads land
// is up to the scheduler and stays put for a whole run: in some runs a
// 1 MiB allgather took two to three times as long as in the others, and it
// never did with all of a rank's threads on one CPU (mpiexec -bind-to core,
// or these threads bound by hand; docs/benchmark-notes.md, "Binding a
// rank's threads to one CPU").
//
// So hvd.init() binds every thread of the process to one CPU when a rank
// could not count on more than one anyway: the host's ranks are at least as
// many as the CPUs their affinity allows, and every rank of the host has the
// same affinity (nobody bound them yet). Local rank r takes the r-th of
// those CPUs, modulo their count. Threads started later by a bound thread
// inherit the binding (MXNet's workers that start later, processes forked
// after init). hvd.shutdown() puts the earlier affinity back on every thread
// still bound to that CPU. HVDMX_CPU_BIND: auto (the above, the default),
// core (bind whatever the counts), none (never).
//
// The shared-memory waits decide whether to spin from the CPUs the process
// had before this binding (UsableCpuCount): once bound, the ranks of a host
// still have that many CPUs between them.
//
// Threading: Bind and Unbind are called by the thread that runs hvd.init()
// and hvd.shutdown(), under the job's lock; the queries may be called from
// any thread.
#ifndef HVDMX_CPU_BINDING_H_
#define HVDMX_CPU_BINDING_H_

#include <string>
#include <vector>

namespace hvdmx {

enum class CpuBind : int { kAuto = 0, kCore, kNone };
std::string CpuBindName(CpuBind mode);

// The CPUs this process may run on now (its calling thread's affinity),
// sorted; empty if the kernel does not say.
std::vector<int> CurrentCpus();

// The CPU local rank `local_rank` of `local_size` binds to under `mode`,
// given the CPUs it may run on and whether every rank of the host has those
// same CPUs; -1: none (see the Note). Pure, for the tests.
int ChooseCpu(CpuBind mode, const std::vector<int>& cpus, int local_rank, int local_size,
              bool same_cpus_on_host);

// Binds every thread of this process to `cpu`, remembering the affinity
// the calling thread had; returns how many threads it bound. A second call
// while bound first unbinds.
int BindAllThreads(int cpu);

// Gives every thread still bound to the CPU of BindAllThreads the
// remembered affinity back; returns how many. Does nothing when not bound.
int UnbindAllThreads();

// The CPU BindAllThreads bound this process to, or -1.
int BoundCpu();

// How many CPUs this process may use: before BindAllThreads bound it, if it
// did (see the Note), else now.
int UsableCpuCount();

}  // namespace hvdmx

#endif  // HVDMX_CPU_BINDING_H_
