// See round_reduction.h, Note [Small tensors in the round].
#include "negotiation/round_reduction.h"

#include <cstring>

#include "algorithms/reduce_kernels.h"

namespace hvdmx {
namespace {

size_t Padded(size_t bytes) { return (bytes + 7) / 8 * 8; }

// The dtype a tensor's operand travels and is reduced in.
DataType PartialType(DataType dtype) { return HalfReducesWide(dtype) ? DataType::kFloat32 : dtype; }

}  // namespace

bool RoundReduction::Carries(int64_t slot) const {
  if (slot < 0 || slot >= cache_.slots()) return false;
  const Response& r = cache_.response(slot);
  return r.type == CollectiveType::kAllreduce && r.error.empty() && r.op != ReduceOp::kAdasum &&
         !r.counts.empty() && r.counts.size() == r.dtypes.size();
}

size_t RoundReduction::OperandBytes(const Response& response) const {
  size_t bytes = 0;
  for (size_t t = 0; t < response.counts.size(); ++t) {
    bytes += Padded(static_cast<size_t>(response.counts[t]) *
                    DataTypeSize(PartialType(response.dtypes[t])));
  }
  return bytes;
}

bool RoundReduction::Takes(int64_t slot, size_t partial_bytes) const {
  if (!enabled() || !Carries(slot)) return false;
  const Response& r = cache_.response(slot);
  return UnitBytes(r) <= unit_bytes_ &&
         static_cast<int64_t>(partial_bytes + 8 + OperandBytes(r)) <= BitAndPartial::kMaxBytes;
}

void RoundReduction::Append(int64_t slot, const std::vector<const void*>& inputs,
                            std::string* partial) const {
  const Response& r = cache_.response(slot);
  HVDMX_CHECK(inputs.size() == r.counts.size(), "one input per tensor of the cached unit");
  const size_t bytes = OperandBytes(r);
  const uint64_t s = static_cast<uint64_t>(slot);
  partial->append(reinterpret_cast<const char*>(&s), 8);
  size_t at = partial->size();
  partial->resize(at + bytes, '\0');
  for (size_t t = 0; t < r.counts.size(); ++t) {
    const int64_t count = r.counts[t];
    const DataType dtype = r.dtypes[t];
    char* out = &(*partial)[at];
    if (HalfReducesWide(dtype)) {
      WidenScaled(reinterpret_cast<float*>(out), inputs[t], count, dtype, r.scale.pre);
    } else {
      // An empty tensor's pointer may be null, which memcpy must never see.
      if (count > 0) std::memcpy(out, inputs[t], static_cast<size_t>(count) * DataTypeSize(dtype));
      ScaleBuffer(out, count, dtype, r.scale.pre);
    }
    at += Padded(static_cast<size_t>(count) * DataTypeSize(PartialType(dtype)));
  }
}

std::vector<RoundReduction::Record> RoundReduction::Parse(const std::string& partial,
                                                          const PeerSender& from) const {
  // See Note [Small tensors in the round] for the format.
  std::vector<Record> records;
  PeerInput in(partial, from, "a bit-and partial");
  while (!in.done()) {
    const int64_t slot = in.Int64In("record's cache slot", 0, cache_.slots() - 1);
    if (!Carries(slot)) {
      in.Fail("a record for cache slot " + std::to_string(slot) +
              ", which holds no allreduce the round carries");
    }
    if (!records.empty() && slot <= records.back().slot) {
      in.Fail("cache slot " + std::to_string(slot) + " after slot " +
              std::to_string(records.back().slot) + ", where slots must ascend");
    }
    const size_t bytes = OperandBytes(cache_.response(slot));
    const size_t at = in.position();
    in.Skip(bytes, "record's operands");
    records.push_back(Record{slot, at, bytes});
  }
  return records;
}

void RoundReduction::Check(const std::string& partial, const PeerSender& from) const {
  Parse(partial, from);
}

std::string RoundReduction::Combine(const std::string& low, const std::string& high,
                                    const PeerSender& from) const {
  const std::vector<Record> a = Parse(low, from);
  const std::vector<Record> b = Parse(high, from);
  std::string out;
  for (size_t i = 0, j = 0; i < a.size() && j < b.size();) {
    if (a[i].slot < b[j].slot) {
      ++i;
    } else if (b[j].slot < a[i].slot) {
      ++j;
    } else {
      const Response& r = cache_.response(a[i].slot);
      out.append(low, a[i].at - 8, 8 + a[i].bytes);
      size_t at = out.size() - a[i].bytes;
      const char* theirs = high.data() + b[j].at;
      for (size_t t = 0; t < r.counts.size(); ++t) {
        const DataType type = PartialType(r.dtypes[t]);
        ReduceInto(&out[at], theirs, r.counts[t], type, r.op);
        const size_t step = Padded(static_cast<size_t>(r.counts[t]) * DataTypeSize(type));
        at += step;
        theirs += step;
      }
      ++i;
      ++j;
    }
  }
  return out;
}

std::map<int64_t, std::string> RoundReduction::Records(const std::string& combined,
                                                       const PeerSender& from) const {
  std::map<int64_t, std::string> out;
  for (const Record& r : Parse(combined, from)) out.emplace(r.slot, combined.substr(r.at, r.bytes));
  return out;
}

void RoundReduction::WriteOut(const Response& response, const std::string& reduced, double post,
                              const std::vector<void*>& outputs) {
  size_t at = 0;
  for (size_t t = 0; t < response.counts.size(); ++t) {
    const int64_t count = response.counts[t];
    const DataType dtype = response.dtypes[t];
    const char* in = reduced.data() + at;
    if (HalfReducesWide(dtype)) {
      NarrowScaled(outputs[t], reinterpret_cast<const float*>(in), count, dtype, post);
    } else {
      if (count > 0) std::memcpy(outputs[t], in, static_cast<size_t>(count) * DataTypeSize(dtype));
      ScaleBuffer(outputs[t], count, dtype, post);
    }
    at += Padded(static_cast<size_t>(count) * DataTypeSize(PartialType(dtype)));
  }
}

}  // namespace hvdmx
