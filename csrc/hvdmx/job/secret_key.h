// The key the job's TCP connections prove (Config::secret_key), agreed at
// hvd.init().
#ifndef HVDMX_SECRET_KEY_H_
#define HVDMX_SECRET_KEY_H_

#include <string>

#include "base/common.h"
#include "comm/group.h"

namespace hvdmx {

// Makes sure every rank of `group` holds a secret key for the job's TCP
// connections (Config::secret_key): if no rank has one, rank 0 makes one
// from the operating system's random source and sends it over `group`,
// when its channel is private (an MPI communicator: the launcher's, which
// it already trusts); a group that is not (a rendezvous over the network)
// never carries one, and a job on it without a key is an error. If every
// rank has one, each keeps its own (ranks with different keys then refuse
// each other's connections); if only some do, an error on every rank says
// so. A key from rank 0 of another length than kSecretKeyBytes fails with
// kPeerProtocol naming rank 0 and the length. Collective over `group`.
Status AgreeOnSecretKey(Group& group, std::string* key);

}  // namespace hvdmx

#endif  // HVDMX_SECRET_KEY_H_
