// Which ranks of a group share a host: a value, computed once for the job at
// hvd.init() (job/host_split.h) and handed to everything that needs it (the
// job's topology, the choice of transport, the shared memory, the
// hierarchical Adasum), so that no two of them can disagree about it.
//
// Hosts are numbered in the order of their lowest rank; a host's ranks are
// listed in ascending order. A value, immutable once made: any thread may
// read it.
#ifndef HVDMX_HOST_MAP_H_
#define HVDMX_HOST_MAP_H_

#include <cstdint>
#include <string>
#include <vector>

namespace hvdmx {

class HostMap {
 public:
  // One rank, alone on its host.
  HostMap() : HostMap(std::vector<int64_t>{0}) {}
  // From every rank's label (index = rank): ranks with equal labels share a
  // host. The labels are this process's own values (a caller that read them
  // from a peer has checked them).
  explicit HostMap(const std::vector<int64_t>& labels);
  // Equal keys (e.g. host names), one host.
  static HostMap FromKeys(const std::vector<std::string>& keys);
  // Runs of `ranks_per_host` consecutive ranks (the last may be shorter), as
  // HVDMX_TESTING_RANKS_PER_HOST pretends.
  static HostMap Consecutive(int size, int ranks_per_host);

  int size() const { return static_cast<int>(host_of_.size()); }
  int host_count() const { return static_cast<int>(hosts_.size()); }
  int host_of(int rank) const { return host_of_[static_cast<size_t>(rank)]; }
  // The ranks on `rank`'s host, ascending (the first is the host's leader).
  const std::vector<int>& host_ranks(int rank) const {
    return hosts_[static_cast<size_t>(host_of(rank))];
  }
  int local_rank(int rank) const { return local_rank_[static_cast<size_t>(rank)]; }
  int local_size(int rank) const { return static_cast<int>(host_ranks(rank).size()); }
  // The ranks with `rank`'s local rank, one a host (MPI's cross communicator).
  int cross_rank(int rank) const;
  int cross_size(int rank) const;
  // The lowest rank of each host, ascending.
  std::vector<int> leaders() const;
  // The fewest and the most ranks on a host.
  int min_host_size() const;
  int max_host_size() const;
  // Every host's ranks, hosts in the order of their lowest rank.
  const std::vector<std::vector<int>>& hosts() const { return hosts_; }

  // The map of the group made of `ranks` (index = rank there, value = rank
  // here, each in range).
  HostMap Subset(const std::vector<int>& ranks) const;

 private:
  std::vector<int> host_of_;
  std::vector<int> local_rank_;
  std::vector<std::vector<int>> hosts_;
};

}  // namespace hvdmx

#endif  // HVDMX_HOST_MAP_H_
