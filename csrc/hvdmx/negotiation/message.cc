#include "negotiation/message.h"

#include <cstring>
#include <sstream>

namespace hvdmx {
namespace {

class Writer {
 public:
  template <typename T>
  void Pod(T value) {
    out_.append(reinterpret_cast<const char*>(&value), sizeof(T));
  }
  void Str(const std::string& s) {
    Pod<int64_t>(static_cast<int64_t>(s.size()));
    out_.append(s);
  }
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

class Reader {
 public:
  explicit Reader(const std::string& in) : in_(in) {}
  template <typename T>
  T Pod() {
    HVDMX_CHECK(pos_ + sizeof(T) <= in_.size(), "truncated negotiation message");
    T value;
    std::memcpy(&value, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return value;
  }
  std::string Str() {
    int64_t len = Pod<int64_t>();
    HVDMX_CHECK(len >= 0 && pos_ + len <= in_.size(), "truncated negotiation message");
    std::string s = in_.substr(pos_, len);
    pos_ += len;
    return s;
  }
  bool done() const { return pos_ == in_.size(); }

 private:
  const std::string& in_;
  size_t pos_ = 0;
};

std::string JoinTypes(const std::vector<DataType>& dtypes) {
  std::string out;
  for (size_t i = 0; i < dtypes.size(); ++i) out += (i ? ", " : "") + DataTypeName(dtypes[i]);
  return dtypes.size() == 1 ? out : "[" + out + "]";
}

std::string JoinShapes(const std::vector<std::vector<int64_t>>& shapes) {
  std::string out;
  for (size_t i = 0; i < shapes.size(); ++i) out += (i ? ", " : "") + ShapeString(shapes[i]);
  return shapes.size() == 1 ? out : "[" + out + "]";
}

std::string DeviceName(int32_t device) {
  return device < 0 ? "cpu" : "gpu(" + std::to_string(device) + ")";
}

std::string FormatScale(double v) {
  std::ostringstream out;
  out.precision(17);
  out << v;
  return out.str();
}

}  // namespace

bool Request::SameParams(const Request& o) const {
  return type == o.type && name == o.name && dtypes == o.dtypes && shapes == o.shapes &&
         op == o.op && root == o.root && scale == o.scale && device == o.device &&
         sizes_only == o.sizes_only && splits == o.splits;
}

int64_t ElementCount(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t UnitBytes(const Response& response) {
  int64_t bytes = 0;
  for (size_t t = 0; t < response.counts.size(); ++t) {
    bytes += response.counts[t] * static_cast<int64_t>(DataTypeSize(response.dtypes[t]));
  }
  return bytes;
}

Response ErrorResponse(const Request& request, std::string message) {
  Response r;
  r.type = request.type;
  r.name = request.name;
  r.sizes_only = request.sizes_only;
  r.error = std::move(message);
  return r;
}

namespace {

// Allgather and alltoall let dim 0 differ between ranks; they must agree on
// the rest of the shape.
std::string TrailingShapes(const Request& q) {
  std::string out;
  for (size_t t = 0; t < q.shapes.size(); ++t) {
    const auto& shape = q.shapes[t];
    out += t ? ", (*" : "(*";
    for (size_t i = 1; i < shape.size(); ++i) out += ", " + std::to_string(shape[i]);
    out += shape.empty() ? " scalar)" : ")";
  }
  return q.shapes.size() == 1 ? out : "[" + out + "]";
}

std::string JoinInts(const std::vector<int64_t>& values) {
  std::string out;
  for (size_t i = 0; i < values.size(); ++i) out += (i ? ", " : "") + std::to_string(values[i]);
  return "[" + out + "]";
}

// The every-rank sizes a sizes round delivers (see Response::splits).
std::vector<int64_t> GatherSizes(const std::vector<Request>& requests) {
  const Request& first = requests[0];
  std::vector<int64_t> splits;
  if (first.type == CollectiveType::kAlltoall) {
    for (const Request& q : requests) splits.insert(splits.end(), q.splits.begin(), q.splits.end());
    return splits;
  }
  for (size_t t = 0; t < first.shapes.size(); ++t) {
    for (const Request& q : requests) splits.push_back(q.shapes[t].empty() ? 1 : q.shapes[t][0]);
  }
  return splits;
}

}  // namespace

Response MakeResponse(const std::vector<Request>& requests) {
  const Request& first = requests[0];
  Response r;
  r.type = first.type;
  r.name = first.name;
  r.dtypes = first.dtypes;
  r.op = first.op;
  r.root = first.root;
  r.scale = first.scale;
  r.sizes_only = first.sizes_only;
  for (const auto& shape : first.shapes) r.counts.push_back(ElementCount(shape));

  for (const Request& q : requests) {
    if (q.error.empty()) continue;
    std::ostringstream msg;
    msg << "hvdmx: " << CollectiveTypeName(first.type) << " of tensor '" << first.name
        << "' failed on rank " << q.rank << ", so it has failed on every rank: " << q.error;
    r.error = msg.str();
    return r;
  }

  const CollectiveType type = first.type;
  const bool ragged = type == CollectiveType::kAllgather || type == CollectiveType::kAlltoall;
  const bool reduces = type == CollectiveType::kAllreduce || type == CollectiveType::kReducescatter;
  const bool has_tensors = type != CollectiveType::kBarrier && type != CollectiveType::kJoin;

  // The first property that differs names the problem; the message lists
  // every rank's value so the user sees who is out of step.
  struct Property {
    const char* what;
    bool applies;
    std::string (*value)(const Request&);
  };
  const Property kProperties[] = {
      {"collective", true, [](const Request& q) { return CollectiveTypeName(q.type); }},
      {"number of tensors", has_tensors,
       [](const Request& q) { return std::to_string(q.shapes.size()); }},
      {"dtype", has_tensors, [](const Request& q) { return JoinTypes(q.dtypes); }},
      {"shape", has_tensors && !ragged, [](const Request& q) { return JoinShapes(q.shapes); }},
      {"shape after the first dimension", ragged, &TrailingShapes},
      {"sizes", ragged && !first.sizes_only, [](const Request& q) { return JoinInts(q.splits); }},
      {"op", reduces, [](const Request& q) { return ReduceOpName(q.op); }},
      {"root_rank", type == CollectiveType::kBroadcast,
       [](const Request& q) { return std::to_string(q.root); }},
      {"prescale_factor", reduces, [](const Request& q) { return FormatScale(q.scale.pre); }},
      {"postscale_factor", reduces, [](const Request& q) { return FormatScale(q.scale.post); }},
      {"device", has_tensors, [](const Request& q) { return DeviceName(q.device); }},
  };
  for (const Property& prop : kProperties) {
    if (!prop.applies) continue;
    const std::string want = prop.value(first);
    bool differs = false;
    for (const Request& q : requests) differs |= prop.value(q) != want;
    if (!differs) continue;
    // A sizes round runs under the name plus "#sizes" (hvdmx/gather_scatter.py); the
    // user knows the name they gave.
    std::string shown = first.name;
    const std::string suffix = "#sizes";
    if (first.sizes_only && shown.size() > suffix.size() &&
        shown.compare(shown.size() - suffix.size(), suffix.size(), suffix) == 0) {
      shown.resize(shown.size() - suffix.size());
    }
    std::ostringstream msg;
    msg << "hvdmx: " << CollectiveTypeName(type) << " of tensor '" << shown
        << "' was called with different " << prop.what << " on different ranks: ";
    for (size_t i = 0; i < requests.size(); ++i) {
      msg << (i ? ", " : "") << "rank " << requests[i].rank << " has " << prop.value(requests[i]);
    }
    msg << ". Every rank must call it with the same " << prop.what
        << "; check that all ranks run the same code on the same shapes in the same order.";
    r.error = msg.str();
    return r;
  }
  if (ragged) r.splits = first.sizes_only ? GatherSizes(requests) : first.splits;
  return r;
}

namespace {

void WriteRequests(Writer* w, const std::vector<Request>& requests) {
  w->Pod<int64_t>(static_cast<int64_t>(requests.size()));
  for (const Request& q : requests) {
    w->Pod(q.rank);
    w->Pod(q.type);
    w->Str(q.name);
    w->Pod<int64_t>(static_cast<int64_t>(q.dtypes.size()));
    for (DataType d : q.dtypes) w->Pod(d);
    w->Pod<int64_t>(static_cast<int64_t>(q.shapes.size()));
    for (const auto& shape : q.shapes) {
      w->Pod<int64_t>(static_cast<int64_t>(shape.size()));
      for (int64_t d : shape) w->Pod(d);
    }
    w->Pod(q.op);
    w->Pod(q.root);
    w->Pod(q.scale.pre);
    w->Pod(q.scale.post);
    w->Pod(q.device);
    w->Pod(q.sizes_only);
    w->Pod<int64_t>(static_cast<int64_t>(q.splits.size()));
    for (int64_t v : q.splits) w->Pod(v);
    w->Pod(q.stalled);
    w->Str(q.error);
  }
}

std::vector<Request> ReadRequests(Reader* r) {
  std::vector<Request> out(r->Pod<int64_t>());
  for (Request& q : out) {
    q.rank = r->Pod<int32_t>();
    q.type = r->Pod<CollectiveType>();
    q.name = r->Str();
    q.dtypes.resize(r->Pod<int64_t>());
    for (DataType& d : q.dtypes) d = r->Pod<DataType>();
    q.shapes.resize(r->Pod<int64_t>());
    for (auto& shape : q.shapes) {
      shape.resize(r->Pod<int64_t>());
      for (int64_t& d : shape) d = r->Pod<int64_t>();
    }
    q.op = r->Pod<ReduceOp>();
    q.root = r->Pod<int32_t>();
    q.scale.pre = r->Pod<double>();
    q.scale.post = r->Pod<double>();
    q.device = r->Pod<int32_t>();
    q.sizes_only = r->Pod<bool>();
    q.splits.resize(r->Pod<int64_t>());
    for (int64_t& v : q.splits) v = r->Pod<int64_t>();
    q.stalled = r->Pod<bool>();
    q.error = r->Str();
  }
  return out;
}

}  // namespace

std::string SerializeRequests(const std::vector<Request>& requests) {
  Writer w;
  WriteRequests(&w, requests);
  return w.Take();
}

std::vector<Request> ParseRequests(const std::string& bytes) {
  Reader r(bytes);
  std::vector<Request> out = ReadRequests(&r);
  HVDMX_CHECK(r.done(), "trailing bytes in request list");
  return out;
}

std::string SerializeRequests(const std::vector<Request>& requests,
                              const std::vector<int64_t>& slots) {
  HVDMX_CHECK(slots.size() == requests.size(), "one cache slot per request");
  Writer w;
  WriteRequests(&w, requests);
  for (int64_t slot : slots) w.Pod(slot);
  return w.Take();
}

std::vector<Request> ParseRequests(const std::string& bytes, std::vector<int64_t>* slots) {
  Reader r(bytes);
  std::vector<Request> out = ReadRequests(&r);
  slots->resize(out.size());
  for (int64_t& slot : *slots) slot = r.Pod<int64_t>();
  HVDMX_CHECK(r.done(), "trailing bytes in request list");
  return out;
}

std::string SerializeResponses(const std::vector<Response>& responses) {
  Writer w;
  w.Pod<int64_t>(static_cast<int64_t>(responses.size()));
  for (const Response& p : responses) {
    w.Pod(p.type);
    w.Str(p.name);
    w.Pod<int64_t>(static_cast<int64_t>(p.dtypes.size()));
    for (DataType d : p.dtypes) w.Pod(d);
    w.Pod<int64_t>(static_cast<int64_t>(p.counts.size()));
    for (int64_t c : p.counts) w.Pod(c);
    w.Pod(p.op);
    w.Pod(p.root);
    w.Pod(p.scale.pre);
    w.Pod(p.scale.post);
    w.Pod(p.sizes_only);
    w.Pod<int64_t>(static_cast<int64_t>(p.splits.size()));
    for (int64_t v : p.splits) w.Pod(v);
    w.Str(p.error);
  }
  return w.Take();
}

std::vector<Response> ParseResponses(const std::string& bytes) {
  Reader r(bytes);
  std::vector<Response> out(r.Pod<int64_t>());
  for (Response& p : out) {
    p.type = r.Pod<CollectiveType>();
    p.name = r.Str();
    p.dtypes.resize(r.Pod<int64_t>());
    for (DataType& d : p.dtypes) d = r.Pod<DataType>();
    p.counts.resize(r.Pod<int64_t>());
    for (int64_t& c : p.counts) c = r.Pod<int64_t>();
    p.op = r.Pod<ReduceOp>();
    p.root = r.Pod<int32_t>();
    p.scale.pre = r.Pod<double>();
    p.scale.post = r.Pod<double>();
    p.sizes_only = r.Pod<bool>();
    p.splits.resize(r.Pod<int64_t>());
    for (int64_t& v : p.splits) v = r.Pod<int64_t>();
    p.error = r.Str();
  }
  HVDMX_CHECK(r.done(), "trailing bytes in response list");
  return out;
}

}  // namespace hvdmx
