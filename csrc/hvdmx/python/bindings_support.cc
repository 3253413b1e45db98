// See bindings_support.h.
#include "python/bindings_support.h"

#include <stdexcept>
#include <utility>

#include "comm/comm.h"
#include "config/env_config.h"

namespace py = pybind11;

namespace hvdmx {

void ThrowIfError(const Status& status) {
  if (status.ok()) return;
  if (status.code() == Status::Code::kInvalidArgument) throw py::value_error(status.message());
  if (status.code() == Status::Code::kPeerProtocol) {
    // hvdmx.errors.PeerProtocolError, the class hvdmx/_job.py maps the code to.
    const py::object cls = py::module_::import("hvdmx.errors").attr("PeerProtocolError");
    PyErr_SetString(cls.ptr(), status.message().c_str());
    throw py::error_already_set();
  }
  throw std::runtime_error(status.message());
}

Status InitStatus(const std::function<Status()>& init) {
  try {
    return init();
  } catch (const PeerProtocolError& e) {
    return Status::PeerProtocol(e.what());
  }
}

void AddStatusCodes(py::module_& m) {
  for (const auto& code :
       {std::make_pair("STATUS_OK", Status::Code::kOk),
        std::make_pair("STATUS_INVALID_ARGUMENT", Status::Code::kInvalidArgument),
        std::make_pair("STATUS_MISMATCH", Status::Code::kMismatch),
        std::make_pair("STATUS_SHUTDOWN", Status::Code::kShutdown),
        std::make_pair("STATUS_INTERNAL", Status::Code::kInternal),
        std::make_pair("STATUS_PEER_SHUTDOWN", Status::Code::kPeerShutdown),
        std::make_pair("STATUS_STALLED", Status::Code::kStalled),
        std::make_pair("STATUS_PEER_GONE", Status::Code::kPeerGone),
        std::make_pair("STATUS_PEER_PROTOCOL", Status::Code::kPeerProtocol)}) {
    m.attr(code.first) = static_cast<int>(code.second);
  }
}

Request MakeRequest(const CollectiveArgs& args, int rank) {
  Request q;
  q.rank = rank;
  q.type = args.type;
  q.name = args.name;
  for (int d : args.dtypes) q.dtypes.push_back(static_cast<DataType>(d));
  q.shapes = args.shapes;
  q.op = static_cast<ReduceOp>(args.op);
  q.root = args.root;
  q.scale = args.scale;
  q.splits = args.splits;
  q.sizes_only = args.sizes_only;
  q.device = args.dev_type == 2 ? args.dev_id : -1;
  return q;
}

py::object DirectMinBytesValue(int64_t direct_min_bytes) {
  if (direct_min_bytes == kShmDirectAuto) return py::str("auto");
  return py::int_(direct_min_bytes);
}

}  // namespace hvdmx
