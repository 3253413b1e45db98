#include "negotiation/message.h"

#include <cassert>
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

// The fewest bytes a request and a response take on the wire (every
// vector and string empty), which caps a list's count by the bytes left.
constexpr size_t kMinRequestBytes = 4 + 4 + 8 + 8 + 8 + 4 + 4 + 8 + 8 + 4 + 1 + 8 + 1 + 8;
constexpr size_t kMinResponseBytes = 4 + 8 + 8 + 8 + 4 + 4 + 8 + 8 + 1 + 8 + 8;
constexpr int64_t kLastCollective = static_cast<int64_t>(CollectiveType::kJoin);
constexpr int64_t kLastReduceOp = static_cast<int64_t>(ReduceOp::kProduct);
constexpr int64_t kMaxDevice = INT32_MAX;

DataType ReadDataType(PeerInput* in) {
  const int32_t code = in->Raw<int32_t>("dtype");
  if (!IsSupportedDataType(code)) {
    in->Fail("dtype code " + std::to_string(code) + ", which is none that hvdmx knows");
  }
  return static_cast<DataType>(code);
}

// Adds `elements` to a unit's running total, which must stay within
// kMaxWireElements.
void CountElements(PeerInput* in, int64_t elements, int64_t* total) {
  if (elements > kMaxWireElements - *total) {
    in->Fail("more than " + std::to_string(kMaxWireElements) + " elements in one unit");
  }
  *total += elements;
}

std::vector<Request> ReadRequests(PeerInput* in, int size) {
  std::vector<Request> out(static_cast<size_t>(in->Count("requests", kMinRequestBytes)));
  for (Request& q : out) {
    q.rank = static_cast<int32_t>(in->Int32In("rank", 0, size - 1));
    if (q.rank != in->from().rank) {
      in->Fail("a request of rank " + std::to_string(q.rank) + ", where a rank sends only its own");
    }
    q.type = static_cast<CollectiveType>(in->Int32In("collective type", 0, kLastCollective));
    q.name = in->String("name");
    q.dtypes.resize(static_cast<size_t>(in->Count("dtypes", sizeof(int32_t))));
    for (DataType& d : q.dtypes) d = ReadDataType(in);
    q.shapes.resize(static_cast<size_t>(in->Count("shapes", sizeof(int64_t))));
    if (q.shapes.size() != q.dtypes.size()) {
      in->Fail(std::to_string(q.shapes.size()) + " shapes for " + std::to_string(q.dtypes.size()) +
               " dtypes, where a request has one of each per tensor");
    }
    int64_t total = 0;
    for (auto& shape : q.shapes) {
      shape.resize(static_cast<size_t>(in->Count("dimensions", sizeof(int64_t))));
      int64_t elements = 1;
      for (int64_t& d : shape) {
        d = in->Int64In("dimension", 0, kMaxWireElements);
        if (d != 0 && elements > kMaxWireElements / d) {
          in->Fail("a shape of more than " + std::to_string(kMaxWireElements) + " elements");
        }
        elements *= d;
      }
      CountElements(in, elements, &total);
    }
    q.op = static_cast<ReduceOp>(in->Int32In("reduce op", 0, kLastReduceOp));
    q.root = static_cast<int32_t>(in->Int32In("root", 0, size - 1));
    q.scale.pre = in->Raw<double>("prescale factor");
    q.scale.post = in->Raw<double>("postscale factor");
    q.device = static_cast<int32_t>(in->Int32In("device", -1, kMaxDevice));
    q.sizes_only = in->Flag("sizes_only");
    q.splits.resize(static_cast<size_t>(in->Count("splits", sizeof(int64_t))));
    if (q.type == CollectiveType::kAlltoall && q.sizes_only &&
        q.splits.size() != static_cast<size_t>(size)) {
      in->Fail("an alltoall's sizes with " + std::to_string(q.splits.size()) + " splits among " +
               std::to_string(size) + " ranks, where it has one per rank");
    }
    for (int64_t& v : q.splits) v = in->Int64In("split", 0, kMaxWireElements);
    q.stalled = in->Flag("stalled");
    q.error = in->String("error");
  }
  return out;
}

}  // namespace

std::string SerializeRequests(const std::vector<Request>& requests) {
  Writer w;
  WriteRequests(&w, requests);
  return w.Take();
}

std::vector<Request> ParseRequests(const std::string& bytes, const PeerSender& from, int size) {
  PeerInput in(bytes, from, "a request list");
  std::vector<Request> out = ReadRequests(&in, size);
  in.End();
  return out;
}

std::string SerializeRequests(const std::vector<Request>& requests,
                              const std::vector<int64_t>& slots) {
  assert(slots.size() == requests.size() && "one cache slot per request");
  Writer w;
  WriteRequests(&w, requests);
  for (int64_t slot : slots) w.Pod(slot);
  return w.Take();
}

std::vector<Request> ParseRequests(const std::string& bytes, const PeerSender& from, int size,
                                   int64_t cache_capacity, std::vector<int64_t>* slots) {
  PeerInput in(bytes, from, "a request list with cache slots");
  std::vector<Request> out = ReadRequests(&in, size);
  slots->resize(out.size());
  for (int64_t& slot : *slots) slot = in.Int64In("cache slot", -1, cache_capacity - 1);
  in.End();
  return out;
}

std::string SerializeResponses(const std::vector<Response>& responses) {
  Writer w;
  w.Pod(false);  // a response list, not a failure
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

std::string SerializePeerFailure(int rank, const std::string& message) {
  Writer w;
  w.Pod(true);
  w.Pod<int32_t>(rank);
  w.Str(message);
  return w.Take();
}

std::vector<Response> ParseResponses(const std::string& bytes, const PeerSender& from, int size) {
  PeerInput in(bytes, from, "a response list");
  if (in.Flag("failure")) {
    const int rank = static_cast<int>(in.Int32In("failed rank", 0, size - 1));
    const std::string message = in.String("failure's message");
    in.End();
    throw PeerProtocolError(rank, message);
  }
  std::vector<Response> out(static_cast<size_t>(in.Count("responses", kMinResponseBytes)));
  for (Response& p : out) {
    p.type = static_cast<CollectiveType>(in.Int32In("collective type", 0, kLastCollective));
    p.name = in.String("name");
    p.dtypes.resize(static_cast<size_t>(in.Count("dtypes", sizeof(int32_t))));
    for (DataType& d : p.dtypes) d = ReadDataType(&in);
    p.counts.resize(static_cast<size_t>(in.Count("counts", sizeof(int64_t))));
    if (p.counts.size() != p.dtypes.size()) {
      in.Fail(std::to_string(p.counts.size()) + " counts for " + std::to_string(p.dtypes.size()) +
              " dtypes, where a response has one of each per tensor");
    }
    int64_t total = 0;
    for (int64_t& c : p.counts) {
      c = in.Int64In("count", 0, kMaxWireElements);
      CountElements(&in, c, &total);
    }
    p.op = static_cast<ReduceOp>(in.Int32In("reduce op", 0, kLastReduceOp));
    p.root = static_cast<int32_t>(in.Int32In("root", 0, size - 1));
    p.scale.pre = in.Raw<double>("prescale factor");
    p.scale.post = in.Raw<double>("postscale factor");
    p.sizes_only = in.Flag("sizes_only");
    p.splits.resize(static_cast<size_t>(in.Count("splits", sizeof(int64_t))));
    for (int64_t& v : p.splits) v = in.Int64In("split", 0, kMaxWireElements);
    p.error = in.String("error");
    // What Response::splits says each collective reads; an error carries none.
    size_t want = 0;
    if (p.error.empty() && p.type == CollectiveType::kAllgather) {
      want = p.counts.size() * static_cast<size_t>(size);
    } else if (p.error.empty() && p.type == CollectiveType::kAlltoall) {
      want = static_cast<size_t>(size) * static_cast<size_t>(size);
    }
    if (p.splits.size() != want) {
      in.Fail("a " + CollectiveTypeName(p.type) + " response with " +
              std::to_string(p.splits.size()) + " splits among " + std::to_string(size) +
              " ranks, where " + std::to_string(want) + " were expected");
    }
  }
  in.End();
  return out;
}

void CheckResponseFits(const Request& mine, const Response& response, const PeerSender& from) {
  const auto fail = [&](const std::string& what, const std::string& theirs,
                        const std::string& ours) {
    FailPeerInput(from, "a response for '" + response.name + "' with " + what + " " + theirs +
                            ", where this rank asked for " + ours);
  };
  if (response.type != mine.type) {
    fail("collective", CollectiveTypeName(response.type), CollectiveTypeName(mine.type));
  }
  if (response.dtypes != mine.dtypes) {
    fail("dtype", JoinTypes(response.dtypes), JoinTypes(mine.dtypes));
  }
  if (response.counts.size() != mine.shapes.size()) {
    fail("tensors", std::to_string(response.counts.size()), std::to_string(mine.shapes.size()));
  }
  if (mine.type == CollectiveType::kAllgather || mine.type == CollectiveType::kAlltoall) return;
  for (size_t t = 0; t < mine.shapes.size(); ++t) {
    const int64_t want = ElementCount(mine.shapes[t]);
    if (response.counts[t] != want) {
      fail("tensor " + std::to_string(t) + "'s elements", std::to_string(response.counts[t]),
           std::to_string(want));
    }
  }
}

}  // namespace hvdmx
