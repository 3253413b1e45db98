#include "job/secret_key.h"

#include <vector>

#include "base/crypto.h"

namespace hvdmx {

Status AgreeOnSecretKey(Group& group, std::string* key) {
  const int rank = group.rank(), size = group.size();
  // The lowest rank with a key and the lowest without one (size if none).
  const std::vector<int64_t> all = AllgatherInts(group, {key->empty() ? 0 : 1});
  int with = size, without = size;
  for (int r = size - 1; r >= 0; --r) (all[static_cast<size_t>(r)] ? with : without) = r;
  if (with < size && without < size) {
    return Status::InvalidArgument(
        "hvdmx.init: HVDMX_SECRET_KEY is set for rank " + std::to_string(with) +
        " but not for rank " + std::to_string(without) +
        "; set the same key for every rank (e.g. with mpiexec -genv), or for none, and hvdmx "
        "makes one for the job");
  }
  if (with < size) return Status::Ok();
  if (!group.private_channel()) {
    return Status::InvalidArgument(
        "hvdmx.init: HVDMX_SECRET_KEY is not set, and this job's ranks meet through a "
        "rendezvous on the network, which must not carry a key; start the job with hvdmxrun "
        "(it gives every rank one), or set HVDMX_SECRET_KEY to the same 64 hex digits for "
        "every rank");
  }
  std::string made = rank == 0 ? RandomBytes(kSecretKeyBytes) : std::string();
  *key = GroupBcast(group, made, 0);
  // Peer input (Note [Peer input] in comm/peer_input.h): a key of another
  // length would make every connection's proof fail, or prove nothing.
  if (key->size() != static_cast<size_t>(kSecretKeyBytes)) {
    const size_t got = key->size();
    key->clear();
    return Status::PeerProtocol(
        "hvdmx.init: rank 0 sent a secret key of " + std::to_string(got) + " bytes where " +
        std::to_string(kSecretKeyBytes) +
        " were expected, which the protocol does not allow: the ranks may run different "
        "versions of hvdmx. hvdmx has stopped on this rank: end the job and look at the "
        "other ranks' output (see docs/errors.md)");
  }
  return Status::Ok();
}

}  // namespace hvdmx
