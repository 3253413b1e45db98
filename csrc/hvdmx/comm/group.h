// The ranks a job (or a process set) is made of, as hvd.init sees them
// before any Comm exists: who this rank is, and an allgather through which
// the ranks agree on what a Comm needs (TCP addresses, the shared-memory
// segment's name, the settings, the topology). MpiGroup (mpi_comm.h) runs on
// an MPI communicator; the group of a job started without MPI asks the
// launcher's rendezvous (hvdmx/rendezvous/client.py, bound in python/bindings.cc).
// Init-time only: nothing here is on the path of a collective.
//
// Every call but rank() and size() is collective over the group: all its
// ranks make it, in the same order.
#ifndef HVDMX_GROUP_H_
#define HVDMX_GROUP_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace hvdmx {

class Group {
 public:
  virtual ~Group() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Every rank's string, index = rank.
  virtual std::vector<std::string> Allgather(const std::string& mine) = 0;
  // MPI_Comm_split's meaning: the ranks that pass the same color >= 0 form
  // a group, ordered by (key, rank here); a rank that passes a negative
  // color gets nullptr.
  virtual std::unique_ptr<Group> Split(int color, int key) = 0;
  // The ranks on this rank's host, in this group's order. By default the
  // ranks whose host name is this one's. The job asks once, at init (Note
  // [One host split] in job/host_split.h).
  virtual std::unique_ptr<Group> SplitByHost();
  // Whether bytes sent through Allgather stay between the job's ranks (an
  // MPI communicator: the launcher's own channel), so that a secret may
  // travel through it.
  virtual bool private_channel() const { return false; }
};

// Every rank's `mine`, concatenated in rank order (all must have the same
// length).
std::vector<int64_t> AllgatherInts(Group& group, const std::vector<int64_t>& mine);
// The least and the greatest of every rank's value.
int64_t GroupMin(Group& group, int64_t mine);
int64_t GroupMax(Group& group, int64_t mine);
// `root`'s string on every rank.
std::string GroupBcast(Group& group, const std::string& mine, int root);

}  // namespace hvdmx

#endif  // HVDMX_GROUP_H_
