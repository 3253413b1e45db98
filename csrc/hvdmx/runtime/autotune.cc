#include "runtime/autotune.h"

#include <algorithm>
#include <iterator>

#include "base/logging.h"

namespace hvdmx {
namespace {

const int64_t kFusionCandidates[] = {0, 128 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 128 << 20};
const double kCycleCandidates[] = {0.0, 0.5, 1.0, 2.5, 5.0};
// auto first: it is the default, and wins ties.
const AllreduceAlgo kAlgoCandidates[] = {AllreduceAlgo::kAuto, AllreduceAlgo::kShm,
                                         AllreduceAlgo::kRing, AllreduceAlgo::kNative};
constexpr uint64_t kFusionMask = (uint64_t{1} << 44) - 1;

}  // namespace

uint64_t EncodeSetting(const TunedSetting& s) {
  const uint64_t fusion = static_cast<uint64_t>(s.fusion_threshold) & kFusionMask;
  const uint64_t algo = static_cast<uint64_t>(s.algo) & 0xf;
  const uint64_t cycle = static_cast<uint64_t>(s.cycle_time_ms * 100.0 + 0.5) & 0x7fff;
  return fusion | (algo << 44) | (cycle << 48);
}

bool DecodeSetting(uint64_t word, TunedSetting* out) {
  if (word >> 63) return false;
  out->fusion_threshold = static_cast<int64_t>(word & kFusionMask);
  out->algo = static_cast<AllreduceAlgo>((word >> 44) & 0xf);
  out->cycle_time_ms = static_cast<double>((word >> 48) & 0x7fff) / 100.0;
  return true;
}

Autotuner::Autotuner(const Config& config, bool leader) : leader_(leader) {
  // A fixed value is its dimension's only one.
  if (config.fusion_threshold_fixed) {
    fusions_.push_back(config.fusion_threshold);
  } else {
    fusions_.assign(std::begin(kFusionCandidates), std::end(kFusionCandidates));
  }
  if (config.cycle_time_fixed) {
    cycles_.push_back(config.cycle_time_ms);
  } else {
    cycles_.assign(std::begin(kCycleCandidates), std::end(kCycleCandidates));
  }
  if (config.allreduce_algo_fixed) {
    algos_.push_back(config.allreduce_algo);
  } else {
    algos_.assign(std::begin(kAlgoCandidates), std::end(kAlgoCandidates));
  }
  // Warm up, and start the search, at the configured values where they are
  // candidates.
  for (size_t f = 0; f < fusions_.size(); ++f) {
    if (fusions_[f] == config.fusion_threshold) current_[0] = static_cast<int>(f);
  }
  for (size_t c = 0; c < cycles_.size(); ++c) {
    if (cycles_[c] == config.cycle_time_ms) current_[1] = static_cast<int>(c);
  }
  for (size_t a = 0; a < algos_.size(); ++a) {
    if (algos_[a] == config.allreduce_algo) current_[2] = static_cast<int>(a);
  }
  best_ = current_;
  if (fusions_.size() == 1 && cycles_.size() == 1 && algos_.size() == 1) done_ = true;
  if (leader_ && !config.autotune_log.empty()) {
    log_ = std::fopen(config.autotune_log.c_str(), "w");
    if (log_ == nullptr) {
      HVDMX_LOG(kWarning) << "cannot write the autotune log to '" << config.autotune_log
                          << "'; tuning goes on without it";
    } else {
      std::fprintf(log_,
                   "fusion_threshold_bytes,cycle_time_ms,allreduce_algo,bytes_per_second,"
                   "note\n");
      std::fflush(log_);
    }
  }
}

Autotuner::~Autotuner() {
  if (log_ != nullptr) std::fclose(log_);
}

TunedSetting Autotuner::Setting(const Point& p) const {
  return {fusions_[p[0]], cycles_[p[1]], algos_[p[2]]};
}

void Autotuner::Log(const TunedSetting& s, double score, const char* note) {
  if (log_ == nullptr) return;
  std::fprintf(log_, "%lld,%g,%s,%.6g,%s\n", static_cast<long long>(s.fusion_threshold),
               s.cycle_time_ms, AllreduceAlgoName(s.algo).c_str(), score, note);
  std::fflush(log_);
}

void Autotuner::RoundDone(int64_t bytes, Clock::time_point now) {
  if (!leader_ || done_ || bytes == 0) return;
  if (!started_set_) {
    started_ = now;
    started_set_ = true;
    bytes_ = 0;
    rounds_ = 0;
    return;  // the round that started the trial ran under the old setting
  }
  bytes_ += bytes;
  ++rounds_;
  const double elapsed = std::chrono::duration<double>(now - started_).count();
  if (elapsed < kTrialSeconds || rounds_ < kTrialRounds) return;
  NextTrial(static_cast<double>(bytes_) / elapsed);
}

namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

}  // namespace

void Autotuner::NextSweep() {
  const size_t sizes[kDims] = {fusions_.size(), cycles_.size(), algos_.size()};
  sweep_.clear();
  position_ = 0;
  while (sweep_.empty() && ++dim_ < kDims) {
    if (sizes[dim_] < 2) continue;
    // Every value of this dimension at the best point so far, that point's
    // own value included: it is measured again beside the others.
    for (int v = 0; v < static_cast<int>(sizes[dim_]); ++v) {
      Point p = best_;
      p[dim_] = v;
      sweep_.push_back(p);
    }
  }
  sweep_scores_.assign(sweep_.size(), {});
  if (sweep_.empty()) {
    done_ = true;
    current_ = best_;
    const TunedSetting chosen = Setting(best_);
    Log(chosen, best_score_, "chosen");
    HVDMX_LOG(kInfo) << "autotune chose fusion_threshold=" << chosen.fusion_threshold
                     << " cycle_time_ms=" << chosen.cycle_time_ms
                     << " allreduce_algo=" << AllreduceAlgoName(chosen.algo);
    return;
  }
  current_ = sweep_[0];
}

void Autotuner::EndSweep() {
  std::vector<double> medians;
  size_t incumbent = 0;
  for (size_t i = 0; i < sweep_.size(); ++i) {
    medians.push_back(Median(sweep_scores_[i]));
    if (sweep_[i] == best_) incumbent = i;
  }
  const std::vector<double>& kept = sweep_scores_[incumbent];
  const double bar = *std::max_element(kept.begin(), kept.end()) * (1 + kMargin);
  size_t winner = incumbent;
  for (size_t i = 0; i < sweep_.size(); ++i) {
    const double worst = *std::min_element(sweep_scores_[i].begin(), sweep_scores_[i].end());
    if (worst > bar && (winner == incumbent || medians[i] > medians[winner])) winner = i;
  }
  best_ = sweep_[winner];
  best_score_ = medians[winner];
  Log(Setting(best_), best_score_, "sweep best");
}

void Autotuner::NextTrial(double score) {
  if (dim_ < 0) {
    Log(Setting(current_), score, "warm-up");
    NextSweep();
  } else {
    Log(Setting(current_), score, "trial");
    sweep_scores_[position_ % sweep_.size()].push_back(score);
    if (++position_ == sweep_.size() * kPasses) {
      EndSweep();
      NextSweep();
    } else {
      current_ = sweep_[position_ % sweep_.size()];
    }
  }
  started_set_ = false;
}

}  // namespace hvdmx
