#include "job/comm_wiring.h"

#include <string>
#include <utility>

#include "algorithms/adasum.h"
#include "base/logging.h"
#include "comm/mpi_comm.h"
#include "comm/tcp_comm.h"
#include "job/host_split.h"
#include "job/shm_wiring.h"
#include "negotiation/controller.h"
#include "shm/host_tree_comm.h"
#include "shm/shm_control_comm.h"

namespace hvdmx {

std::unique_ptr<Comm> CommOver(Group& group, const Config& config, bool ranks_outnumber_cpus,
                               CommUse use, const std::vector<int>& more_peers) {
  if (config.transport != Transport::kTcp) {
    auto* mpi = dynamic_cast<MpiGroup*>(&group);
    HVDMX_CHECK(mpi != nullptr, "the MPI transport runs over an MPI communicator");
    return std::make_unique<MpiComm>(mpi->handle());
  }
  const int rank = group.rank(), size = group.size();
  TcpOptions options = TcpOptionsFor(config, ranks_outnumber_cpus);
  options.peers = use == CommUse::kNegotiation
                      ? P2PComm::NegotiationPeers(rank, size, options.direct_bit_and_ranks)
                      : P2PComm::DataPeers(rank, size, more_peers);
  // TcpComm calls the exchange in its constructor only.
  Group* over = &group;
  return std::make_unique<TcpComm>(
      rank, size, options, [over](const std::string& mine) { return over->Allgather(mine); });
}

namespace {

// Whether the ranks of `group` talk over hvdmx's own TCP sockets (see
// Config::transport): always without MPI.
bool UseTcp(Group& group, const HostMap& hosts, Transport transport) {
  if (dynamic_cast<MpiGroup*>(&group) == nullptr) return true;
  if (transport != Transport::kAuto) return transport == Transport::kTcp;
  return hosts.local_size(group.rank()) < group.size();
}

// The negotiation's comm over `group` (Note [The job's comms]), whose real
// hosts `hosts` describes, given its shared memory `shm` (or null).
// Collective over `group`.
std::unique_ptr<ControlComm> NegotiationComm(Group& group, const HostMap& hosts,
                                             const Config& config, bool busy, ShmHost* shm) {
  const int rank = group.rank(), size = group.size();
  const int on_this_host = hosts.local_size(rank);
  const int64_t bit_words = Controller::BitWords(config.cache_capacity);
  const bool fits_shm = bit_words <= ShmControl::kMaxBitAndWords;
  const bool across_hosts = config.transport == Transport::kTcp && on_this_host < size;
  const bool tree = across_hosts && shm != nullptr && shm->hierarchical() && fits_shm;
  if (!tree) {
    // With one rank on every host the leaders are all the ranks: nothing to say.
    if (across_hosts && hosts.max_host_size() > 1 && rank == 0) {
      HVDMX_LOG(kWarning) << "hvdmx: negotiation runs over all " << size
                          << " ranks alike (recursive doubling beyond "
                          << P2PComm::kDirectBitAndRanks
                          << "), not through one leader a host, which needs the same number "
                             "of ranks on every host, shared memory between them and "
                             "HVDMX_HIERARCHICAL_ALLREDUCE not 0 (docs/scaling.md)";
    }
    return ControlThroughShm(CommOver(group, config, busy, CommUse::kNegotiation), shm, bit_words);
  }
  std::unique_ptr<Group> leaders_group = group.Split(shm->rank() == 0 ? 0 : -1, rank);
  std::unique_ptr<P2PComm> leaders;
  if (leaders_group != nullptr) {
    std::unique_ptr<Comm> made = CommOver(*leaders_group, config, busy, CommUse::kNegotiation);
    leaders.reset(dynamic_cast<P2PComm*>(made.release()));
    HVDMX_CHECK(leaders != nullptr, "the leaders' comm is a TCP comm");
  }
  return std::make_unique<HostTreeComm>(&shm->control(), shm->rank(), shm->size(),
                                        std::move(leaders), rank, size);
}

// The ranks the hierarchical Adasum pairs with this one, which the data
// comm links with besides its own (Note [The data comm's links] in
// comm/p2p_comm.h): none unless it is on and the data travels over TCP.
std::vector<int> AdasumPeers(const HostMap& hosts, int rank, const Config& config) {
  if (config.transport != Transport::kTcp || !config.adasum_hierarchical) return {};
  return AdasumHierarchicalPeers(hosts, rank);
}

}  // namespace

std::shared_ptr<Runtime> StartRuntime(Group& group, const HostMap& hosts, Config config,
                                      const NegotiationCommWrapper& wrap) {
  const int rank = group.rank();
  config.transport = UseTcp(group, hosts, config.transport) ? Transport::kTcp : Transport::kMpi;
  const HostMap algorithm_hosts = HostsForAlgorithms(hosts, config);
  const bool busy = config.transport == Transport::kTcp && HostRanksOutnumberCpus(hosts, rank);
  std::unique_ptr<ShmHost> shm = CreateHostShm(group, algorithm_hosts, config, busy);
  std::unique_ptr<ControlComm> control = NegotiationComm(group, hosts, config, busy, shm.get());
  if (wrap) control = wrap(std::move(control));
  std::unique_ptr<Comm> data =
      CommOver(group, config, busy, CommUse::kData, AdasumPeers(algorithm_hosts, rank, config));
  auto runtime =
      std::make_shared<Runtime>(std::move(control), std::move(data), config, std::move(shm),
                                algorithm_hosts, hosts.local_size(rank) > 1);
  runtime->Start();
  return runtime;
}

}  // namespace hvdmx
