// See bindings_support.h.
#include "python/bindings_support.h"

#include <stdexcept>

#include "config/env_config.h"

namespace py = pybind11;

namespace hvdmx {

void ThrowIfError(const Status& status) {
  if (status.ok()) return;
  if (status.code() == Status::Code::kInvalidArgument) throw py::value_error(status.message());
  throw std::runtime_error(status.message());
}

Request MakeRequest(CollectiveType type, const std::string& name, const std::vector<int>& dtypes,
                    const std::vector<std::vector<int64_t>>& shapes, int op, int root,
                    double prescale, double postscale, int dev_type, int dev_id, int rank) {
  Request q;
  q.rank = rank;
  q.type = type;
  q.name = name;
  for (int d : dtypes) q.dtypes.push_back(static_cast<DataType>(d));
  q.shapes = shapes;
  q.op = static_cast<ReduceOp>(op);
  q.root = root;
  q.prescale = prescale;
  q.postscale = postscale;
  q.device = dev_type == 2 ? dev_id : -1;
  return q;
}

py::object DirectMinBytesValue(int64_t direct_min_bytes) {
  if (direct_min_bytes == kShmDirectAuto) return py::str("auto");
  return py::int_(direct_min_bytes);
}

}  // namespace hvdmx
