#include "comm/group.h"

#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>

#include <stdexcept>

namespace hvdmx {

std::unique_ptr<Group> Group::SplitByHost() {
  char name[HOST_NAME_MAX + 1] = {};
  gethostname(name, sizeof(name) - 1);
  const std::vector<std::string> names = Allgather(name);
  // The color of a host: its first rank in this group.
  const int color = static_cast<int>(
      std::find(names.begin(), names.end(), names[static_cast<size_t>(rank())]) - names.begin());
  return Split(color, rank());
}

std::vector<int64_t> AllgatherInts(Group& group, const std::vector<int64_t>& mine) {
  const std::string bytes(reinterpret_cast<const char*>(mine.data()),
                          mine.size() * sizeof(int64_t));
  std::vector<int64_t> all;
  all.reserve(mine.size() * static_cast<size_t>(group.size()));
  int from = 0;
  for (const std::string& theirs : group.Allgather(bytes)) {
    // Every rank runs this code, but the bytes may have come through a
    // rendezvous over the network: checked, not trusted.
    if (theirs.size() != bytes.size()) {
      throw std::runtime_error("hvdmx.init: rank " + std::to_string(from) + " sent " +
                               std::to_string(theirs.size()) + " bytes where " +
                               std::to_string(bytes.size()) +
                               " were due; every rank must run the same hvdmx");
    }
    ++from;
    const size_t at = all.size();
    all.resize(at + mine.size());
    std::memcpy(all.data() + at, theirs.data(), theirs.size());
  }
  return all;
}

int64_t GroupMin(Group& group, int64_t mine) {
  const std::vector<int64_t> all = AllgatherInts(group, {mine});
  return *std::min_element(all.begin(), all.end());
}

int64_t GroupMax(Group& group, int64_t mine) {
  const std::vector<int64_t> all = AllgatherInts(group, {mine});
  return *std::max_element(all.begin(), all.end());
}

std::string GroupBcast(Group& group, const std::string& mine, int root) {
  return group.Allgather(group.rank() == root ? mine : std::string())[static_cast<size_t>(root)];
}

}  // namespace hvdmx
