#include "comm/host_map.h"

#include <algorithm>
#include <map>

namespace hvdmx {

HostMap::HostMap(const std::vector<int64_t>& labels) {
  std::map<int64_t, int> index;
  for (size_t r = 0; r < labels.size(); ++r) {
    auto it = index.find(labels[r]);
    if (it == index.end()) {
      it = index.emplace(labels[r], static_cast<int>(hosts_.size())).first;
      hosts_.emplace_back();
    }
    host_of_.push_back(it->second);
    local_rank_.push_back(static_cast<int>(hosts_[static_cast<size_t>(it->second)].size()));
    hosts_[static_cast<size_t>(it->second)].push_back(static_cast<int>(r));
  }
}

HostMap HostMap::FromKeys(const std::vector<std::string>& keys) {
  std::vector<int64_t> labels;
  for (const std::string& key : keys) {
    labels.push_back(std::find(keys.begin(), keys.end(), key) - keys.begin());
  }
  return HostMap(labels);
}

HostMap HostMap::Consecutive(int size, int ranks_per_host) {
  std::vector<int64_t> labels;
  for (int r = 0; r < size; ++r) labels.push_back(r / ranks_per_host);
  return HostMap(labels);
}

int HostMap::cross_rank(int rank) const {
  int below = 0;
  for (int q = 0; q < rank; ++q) below += local_rank(q) == local_rank(rank) ? 1 : 0;
  return below;
}

int HostMap::cross_size(int rank) const {
  int n = 0;
  for (const std::vector<int>& host : hosts_) {
    n += static_cast<int>(host.size()) > local_rank(rank) ? 1 : 0;
  }
  return n;
}

std::vector<int> HostMap::leaders() const {
  std::vector<int> out;
  for (const std::vector<int>& host : hosts_) out.push_back(host.front());
  return out;
}

int HostMap::min_host_size() const {
  size_t n = hosts_.front().size();
  for (const std::vector<int>& host : hosts_) n = std::min(n, host.size());
  return static_cast<int>(n);
}

int HostMap::max_host_size() const {
  size_t n = 0;
  for (const std::vector<int>& host : hosts_) n = std::max(n, host.size());
  return static_cast<int>(n);
}

HostMap HostMap::Subset(const std::vector<int>& ranks) const {
  std::vector<int64_t> labels;
  for (int r : ranks) labels.push_back(host_of(r));
  return HostMap(labels);
}

}  // namespace hvdmx
