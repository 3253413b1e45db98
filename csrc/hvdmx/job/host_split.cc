#include "job/host_split.h"

#include <stdexcept>
#include <string>

#include "platform/cpu_binding.h"

namespace hvdmx {

HostMap FindHosts(Group& group) {
  const int rank = group.rank(), size = group.size();
  std::unique_ptr<Group> local = group.SplitByHost();
  // A host is named by its lowest rank.
  const std::vector<int64_t> host_of = AllgatherInts(group, {GroupMin(*local, rank)});
  for (int r = 0; r < size; ++r) {
    const int64_t h = host_of[static_cast<size_t>(r)];
    // A host's lowest rank is a rank no greater than the sender's own.
    if (h < 0 || h > r) {
      throw std::runtime_error("hvdmx.init: rank " + std::to_string(r) + " named rank " +
                               std::to_string(h) +
                               " as its host's lowest, which cannot be; every rank must "
                               "run the same hvdmx");
    }
  }
  return HostMap(host_of);
}

HostMap HostsOfSubgroup(Group& sub, const HostMap& hosts, int rank) {
  const std::vector<int64_t> places = AllgatherInts(sub, {rank});
  std::vector<int> ranks;
  for (size_t r = 0; r < places.size(); ++r) {
    const int64_t place = places[r];
    if (place < 0 || place >= hosts.size()) {
      throw std::runtime_error("hvdmx: rank " + std::to_string(r) +
                               " of a process set named rank " + std::to_string(place) +
                               " of the job, which has " + std::to_string(hosts.size()) +
                               "; every rank must run the same hvdmx");
    }
    ranks.push_back(static_cast<int>(place));
  }
  return hosts.Subset(ranks);
}

Topology TopologyOf(const HostMap& hosts, int rank) {
  Topology t;
  t.rank = rank;
  t.size = hosts.size();
  t.local_rank = hosts.local_rank(rank);
  t.local_size = hosts.local_size(rank);
  t.cross_rank = hosts.cross_rank(rank);
  t.cross_size = hosts.cross_size(rank);
  return t;
}

HostMap HostsForAlgorithms(const HostMap& hosts, const Config& config) {
  if (config.testing_ranks_per_host <= 0) return hosts;
  return HostMap::Consecutive(hosts.size(), static_cast<int>(config.testing_ranks_per_host));
}

std::unique_ptr<Group> SplitByHostMap(Group& group, const HostMap& hosts) {
  return group.Split(hosts.host_of(group.rank()), group.rank());
}

bool HostRanksOutnumberCpus(const HostMap& hosts, int rank) {
  return hosts.local_size(rank) > UsableCpuCount();
}

}  // namespace hvdmx
