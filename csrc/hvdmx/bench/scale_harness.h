// The scale harness behind `python -m hvdmx.bench scale`: N ranks of the
// core as threads of one process, without MXNet or MPI, so that hundreds
// fit on a small machine. Hosts are groups of ranks sharing plain memory
// (shm/plain_regions.h); between them the network is real TCP on the
// loopback interface, authenticated as in a job. Each rank runs the
// negotiation's Controller over the comm a job would build
// (HostTreeComm, or every rank over TCP alike), submits the same requests
// every step, and the harness measures the cached rounds: wall time, each
// rank's CPU time, messages and bytes on the network, and the latencies on
// the critical path; optionally a step of a gradient set (a cached round,
// then the hierarchical allreduce of the set in fusion-buffer pieces).
#ifndef HVDMX_BENCH_SCALE_HARNESS_H_
#define HVDMX_BENCH_SCALE_HARNESS_H_

#include <cstdint>
#include <string>
#include <vector>

namespace hvdmx {

struct ScaleOptions {
  int ranks = 2;
  int per_host = 1;  // ranks a host; must divide ranks
  // Negotiation through one leader a host (HostTreeComm) or, false, every
  // rank over the network alike, as when hosts' rank counts differ.
  bool host_tree = true;
  int rounds = 20;     // cached rounds timed
  int requests = 161;  // tensors a round (ResNet-50 has 161 gradients)
  // The gradient set's tensors, in elements (float32); empty: no steps.
  std::vector<int64_t> step_counts;
  int steps = 2;  // steps timed
  int64_t fusion_bytes = int64_t{64} << 20;
  int give_up_seconds = 120;
};

struct ScaleRank {
  std::string error;  // "" if the rank ran to the end
  // Per cached round, averaged over the timed rounds.
  double sent_messages = 0;
  double received_messages = 0;
  double sent_bytes = 0;
  double received_bytes = 0;
  double cpu_seconds = 0;  // this rank's thread
  int hops = 0;            // network latencies on its critical path
  int links = 0;           // network connections its negotiation holds
};

struct ScaleResult {
  std::vector<ScaleRank> ranks;
  double round_seconds = 0;     // wall time a cached round, every rank in it
  double uncached_seconds = 0;  // the first round, every request new
  double step_seconds = -1;     // wall time a step; -1: no steps
  bool step_correct = false;    // every rank's sums were exact
};

// Runs the harness; throws std::invalid_argument naming a bad option.
ScaleResult RunScale(const ScaleOptions& options);

}  // namespace hvdmx

#endif  // HVDMX_BENCH_SCALE_HARNESS_H_
