#include "config/env_config.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <initializer_list>
#include <sstream>
#include <utility>

#include "base/crypto.h"

namespace hvdmx {
namespace {

// Returns the value of HVDMX_<suffix>, else HOROVOD_<suffix>, and which name
// it came from.
std::optional<std::string> Find(const EnvLookup& lookup, const std::string& suffix,
                                std::string* used_name) {
  for (const char* prefix : {"HVDMX_", "HOROVOD_"}) {
    std::string name = prefix + suffix;
    auto value = lookup(name);
    if (value && !value->empty()) {
      *used_name = name;
      return value;
    }
  }
  return std::nullopt;
}

Status Invalid(const std::string& name, const std::string& value, const std::string& accepted) {
  return Status::InvalidArgument("environment variable " + name + "='" + value +
                                 "' is not valid: expected " + accepted + ". Fix or unset it.");
}

Status ReadInt(const EnvLookup& lookup, const std::string& suffix, int64_t min_value,
               const std::string& accepted, int64_t* out) {
  std::string name;
  auto value = Find(lookup, suffix, &name);
  if (!value) return Status::Ok();
  errno = 0;
  char* end = nullptr;
  long long parsed = std::strtoll(value->c_str(), &end, 10);
  if (errno != 0 || end == value->c_str() || *end != '\0' || parsed < min_value) {
    return Invalid(name, *value, accepted);
  }
  *out = parsed;
  return Status::Ok();
}

// A variable that takes one of a few words: *out gets the value paired with
// it; any other word is refused with `accepted`.
template <typename T>
Status ReadWord(const EnvLookup& lookup, const std::string& suffix,
                std::initializer_list<std::pair<const char*, T>> words, const std::string& accepted,
                T* out) {
  std::string name;
  auto value = Find(lookup, suffix, &name);
  if (!value) return Status::Ok();
  for (const auto& [word, meaning] : words) {
    if (*value == word) {
      *out = meaning;
      return Status::Ok();
    }
  }
  return Invalid(name, *value, accepted);
}

Status ReadDouble(const EnvLookup& lookup, const std::string& suffix, const std::string& accepted,
                  double* out) {
  std::string name;
  auto value = Find(lookup, suffix, &name);
  if (!value) return Status::Ok();
  errno = 0;
  char* end = nullptr;
  double parsed = std::strtod(value->c_str(), &end);
  if (errno != 0 || end == value->c_str() || *end != '\0' || !std::isfinite(parsed) || parsed < 0) {
    return Invalid(name, *value, accepted);
  }
  *out = parsed;
  return Status::Ok();
}

}  // namespace

std::string AllreduceAlgoName(AllreduceAlgo algo) {
  switch (algo) {
    case AllreduceAlgo::kAuto: return "auto";
    case AllreduceAlgo::kRing: return "ring";
    case AllreduceAlgo::kNative: return "mpi";
    case AllreduceAlgo::kShm: return "shm";
  }
  return "?";
}

EnvLookup ProcessEnvironment() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* value = std::getenv(name.c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  };
}

const char* TransportName(Transport transport) {
  switch (transport) {
    case Transport::kTcp: return "tcp";
    case Transport::kMpi: return "mpi";
    case Transport::kAuto: break;
  }
  return "auto";
}

Status LoadConfig(const EnvLookup& lookup, Config* out) {
  Config config;
  Status s = ReadInt(lookup, "FUSION_THRESHOLD", 0, "a byte count >= 0 (0 disables fusion)",
                     &config.fusion_threshold);
  if (!s.ok()) return s;
  s = ReadInt(lookup, "FUSION_MAX_TENSOR_BYTES", 0, "a byte count >= 0",
              &config.fusion_max_tensor_bytes);
  if (!s.ok()) return s;
  s = ReadInt(lookup, "FUSION_PIECE_BYTES", 64, "a byte count >= 64", &config.fusion_piece_bytes);
  if (!s.ok()) return s;
  s = ReadInt(lookup, "OUTPUT_POOL_BYTES", 0, "a byte count >= 0 (0 keeps no output memory)",
              &config.output_pool_bytes);
  if (!s.ok()) return s;
  s = ReadDouble(lookup, "CYCLE_TIME", "milliseconds >= 0", &config.cycle_time_ms);
  if (!s.ok()) return s;
  s = ReadInt(lookup, "CACHE_CAPACITY", 0, "an integer >= 0 (0 disables the cache)",
              &config.cache_capacity);
  if (!s.ok()) return s;
  s = ReadInt(lookup, "RING_MIN_BYTES", 0, "a byte count >= 0", &config.ring_min_bytes);
  if (!s.ok()) return s;
  s = ReadInt(lookup, "RING_SEGMENT_BYTES", 64, "a byte count >= 64", &config.ring_segment_bytes);
  if (!s.ok()) return s;
  s = ReadInt(lookup, "SHM_MIN_BYTES", 0, "a byte count >= 0", &config.shm_min_bytes);
  if (!s.ok()) return s;
  s = ReadInt(lookup, "ROUND_ALLREDUCE_BYTES", 0, "a byte count from 0 (off) to 16384",
              &config.round_allreduce_bytes);
  if (!s.ok()) return s;
  if (config.round_allreduce_bytes > Config::kMaxRoundAllreduceBytes) {
    std::string used;
    const std::string raw = Find(lookup, "ROUND_ALLREDUCE_BYTES", &used).value_or("");
    return Invalid(used, raw, "a byte count from 0 (off) to 16384");
  }
  s = ReadInt(lookup, "SHM_CHUNK_BYTES", 64, "a byte count >= 64 and <= 1073741824",
              &config.shm_chunk_bytes);
  if (!s.ok()) return s;
  if (config.shm_chunk_bytes > (int64_t{1} << 30)) {
    std::string used;
    const std::string raw = Find(lookup, "SHM_CHUNK_BYTES", &used).value_or("");
    return Invalid(used, raw, "a byte count >= 64 and <= 1073741824");
  }
  std::string used;
  if (Find(lookup, "SHM_DIRECT_MIN_BYTES", &used) == "auto") {
    config.shm_direct_min_bytes = kShmDirectAuto;
  } else {
    s = ReadInt(lookup, "SHM_DIRECT_MIN_BYTES", -1, "auto, a byte count >= 0, or -1 (never)",
                &config.shm_direct_min_bytes);
    if (!s.ok()) return s;
  }
  s = ReadInt(lookup, "TESTING_RANKS_PER_HOST", 0, "an integer >= 0 (0: the real hosts)",
              &config.testing_ranks_per_host);
  if (!s.ok()) return s;
  s = ReadDouble(lookup, "TESTING_LINK_DELAY_SECONDS", "seconds >= 0",
                 &config.testing_link_delay_seconds);
  if (!s.ok()) return s;
  s = ReadDouble(lookup, "STALL_CHECK_TIME_SECONDS", "seconds >= 0 (0 disables)",
                 &config.stall_check_seconds);
  if (!s.ok()) return s;
  s = ReadDouble(lookup, "STALL_SHUTDOWN_TIME_SECONDS", "seconds >= 0 (0: never)",
                 &config.stall_shutdown_seconds);
  if (!s.ok()) return s;

  std::string name;
  config.fusion_threshold_fixed = Find(lookup, "FUSION_THRESHOLD", &name).has_value();
  config.cycle_time_fixed = Find(lookup, "CYCLE_TIME", &name).has_value();
  if (auto value = Find(lookup, "AUTOTUNE", &name)) {
    if (*value == "1" || *value == "true") {
      config.autotune = true;
    } else if (*value != "0" && *value != "false") {
      return Invalid(name, *value, "1 or 0");
    }
  }
  if (auto value = Find(lookup, "AUTOTUNE_LOG", &name)) config.autotune_log = *value;
  config.elastic = Find(lookup, "ELASTIC_SLOT", &name).has_value();
  if (auto value = Find(lookup, "TIMELINE", &name)) config.timeline_path = *value;
  if (auto value = Find(lookup, "TIMELINE_MARK_CYCLES", &name)) {
    if (*value == "1" || *value == "true") {
      config.timeline_mark_cycles = true;
    } else if (*value == "0" || *value == "false" || value->empty()) {
      config.timeline_mark_cycles = false;
    } else {
      return Invalid(name, *value, "1 or 0");
    }
  }
  s = ReadWord(lookup, "ALLREDUCE_ALGO",
               {{"auto", AllreduceAlgo::kAuto},
                {"ring", AllreduceAlgo::kRing},
                {"mpi", AllreduceAlgo::kNative},
                {"shm", AllreduceAlgo::kShm}},
               "one of auto, ring, mpi, shm", &config.allreduce_algo);
  if (!s.ok()) return s;
  config.allreduce_algo_fixed = Find(lookup, "ALLREDUCE_ALGO", &name).has_value();
  s = ReadWord(
      lookup, "SHM_STREAMING_STORES",
      {{"auto", StageStores::kAuto}, {"0", StageStores::kCached}, {"1", StageStores::kStreaming}},
      "auto, 0 (cached stores) or 1 (streaming stores)", &config.shm_streaming_stores);
  if (!s.ok()) return s;
  s = ReadWord(lookup, "HUGE_PAGES", {{"1", true}, {"0", false}}, "1 or 0", &config.huge_pages);
  if (!s.ok()) return s;
  s = ReadWord(lookup, "SHM_PUSH", {{"1", true}, {"0", false}}, "1 or 0", &config.shm_push);
  if (!s.ok()) return s;
  s = ReadWord(lookup, "ADASUM_HIERARCHICAL", {{"1", true}, {"0", false}}, "1 or 0",
               &config.adasum_hierarchical);
  if (!s.ok()) return s;
  s = ReadWord(lookup, "HALF_PARTIALS", {{"float32", true}, {"half", false}},
               "float32 (exact: partial sums in float32, rounded once) or half (partial sums "
               "rounded at every step, half the ring's reduce-scatter bytes)",
               &config.half_partials_wide);
  if (!s.ok()) return s;
  s = ReadWord(lookup, "TRANSPORT",
               {{"auto", Transport::kAuto}, {"tcp", Transport::kTcp}, {"mpi", Transport::kMpi}},
               "one of auto (tcp when the job spans hosts, else mpi), tcp, mpi", &config.transport);
  if (!s.ok()) return s;
  if (auto value = Find(lookup, "TCP_IFACE", &name)) config.tcp_iface = *value;
  if (auto value = Find(lookup, "SECRET_KEY", &name)) {
    // The value itself is never repeated in a message.
    if (!FromHex(*value, &config.secret_key) || config.secret_key.size() != kSecretKeyBytes) {
      config.secret_key.clear();
      return Status::InvalidArgument(
          "hvdmx: " + name + " must be " + std::to_string(2 * kSecretKeyBytes) +
          " hex digits (a 256-bit key), but it has " + std::to_string(value->size()) +
          " characters" +
          (value->find_first_not_of("0123456789abcdefABCDEF") == std::string::npos
               ? std::string()
               : std::string(", not all of them hex digits")) +
          ". Make one with: python -c 'import secrets; print(secrets.token_hex(32))', or unset "
          "it and hvdmx makes one for the job");
    }
  }
  s = ReadInt(lookup, "TCP_SPIN_MICROS", -1, "microseconds >= 0, or -1 (auto)",
              &config.tcp_spin_micros);
  if (!s.ok()) return s;
  s = ReadWord(lookup, "CPU_BIND",
               {{"auto", CpuBind::kAuto}, {"core", CpuBind::kCore}, {"none", CpuBind::kNone}},
               "one of auto, core, none", &config.cpu_bind);
  if (!s.ok()) return s;
  if (auto value = Find(lookup, "HIERARCHICAL_ALLREDUCE", &name)) {
    if (*value != "0" && *value != "1") return Invalid(name, *value, "0 or 1");
    config.hierarchical_allreduce = *value == "1";
    config.hierarchical_allreduce_set = true;
    config.allreduce_algo_fixed = config.allreduce_algo_fixed || config.hierarchical_allreduce;
  }
  if (auto value = Find(lookup, "LOG_LEVEL", &name)) {
    if (!ParseLogLevel(*value, &config.log_level)) {
      return Invalid(name, *value, "one of trace, debug, info, warning, error, fatal");
    }
  }
  *out = config;
  return Status::Ok();
}

std::string Config::ToString() const {
  std::ostringstream out;
  out << "fusion_threshold=" << fusion_threshold
      << " fusion_max_tensor_bytes=" << fusion_max_tensor_bytes
      << " fusion_piece_bytes=" << fusion_piece_bytes << " output_pool_bytes=" << output_pool_bytes
      << " cycle_time_ms=" << cycle_time_ms << " cache_capacity=" << cache_capacity
      << " allreduce_algo=" << AllreduceAlgoName(allreduce_algo)
      << " ring_min_bytes=" << ring_min_bytes << " ring_segment_bytes=" << ring_segment_bytes
      << " round_allreduce_bytes=" << round_allreduce_bytes << " shm_min_bytes=" << shm_min_bytes
      << " shm_chunk_bytes=" << shm_chunk_bytes << " shm_direct_min_bytes="
      << (shm_direct_min_bytes == kShmDirectAuto ? std::string("auto")
                                                 : std::to_string(shm_direct_min_bytes))
      << " shm_streaming_stores=" << StageStoresName(shm_streaming_stores)
      << " huge_pages=" << huge_pages << " shm_push=" << shm_push
      << " half_partials=" << (half_partials_wide ? "float32" : "half")
      << " cpu_bind=" << CpuBindName(cpu_bind) << " hierarchical_allreduce="
      << (hierarchical_allreduce_set ? std::to_string(hierarchical_allreduce) : "auto")
      << " adasum_hierarchical=" << adasum_hierarchical << " transport=" << TransportName(transport)
      << " tcp_iface='" << tcp_iface << "'"
      << " testing_ranks_per_host=" << testing_ranks_per_host
      << " stall_check_seconds=" << stall_check_seconds
      << " stall_shutdown_seconds=" << stall_shutdown_seconds << " elastic=" << elastic
      << " timeline='" << timeline_path << "' timeline_mark_cycles=" << timeline_mark_cycles
      << " autotune=" << autotune << " autotune_log='" << autotune_log << "'";
  return out.str();
}

}  // namespace hvdmx
