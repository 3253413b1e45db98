#include "autotune.h"

#include <iterator>

#include "logging.h"

namespace hvdmx {
namespace {

const int64_t kFusionCandidates[] = {0, 128 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20,
                                     128 << 20};
const double kCycleCandidates[] = {0.0, 0.5, 1.0, 2.5, 5.0};

}  // namespace

uint64_t EncodeSetting(const TunedSetting& s) {
  const uint64_t fusion = static_cast<uint64_t>(s.fusion_threshold) & ((uint64_t{1} << 48) - 1);
  const uint64_t cycle = static_cast<uint64_t>(s.cycle_time_ms * 100.0 + 0.5) & 0x7fff;
  return fusion | (cycle << 48);
}

bool DecodeSetting(uint64_t word, TunedSetting* out) {
  if (word >> 63) return false;
  out->fusion_threshold = static_cast<int64_t>(word & ((uint64_t{1} << 48) - 1));
  out->cycle_time_ms = static_cast<double>((word >> 48) & 0x7fff) / 100.0;
  return true;
}

Autotuner::Autotuner(const Config& config, bool leader)
    : leader_(leader),
      tune_fusion_(!config.fusion_threshold_fixed),
      tune_cycle_(!config.cycle_time_fixed) {
  // candidates_[f * C + c]: fusion f, cycle c; a fixed value is the only one.
  std::vector<int64_t> fusions;
  std::vector<double> cycles;
  if (tune_fusion_) {
    fusions.assign(std::begin(kFusionCandidates), std::end(kFusionCandidates));
  } else {
    fusions.push_back(config.fusion_threshold);
  }
  if (tune_cycle_) {
    cycles.assign(std::begin(kCycleCandidates), std::end(kCycleCandidates));
  } else {
    cycles.push_back(config.cycle_time_ms);
  }
  for (int64_t f : fusions) {
    for (double c : cycles) candidates_.push_back({f, c});
  }
  const int n_cycles = static_cast<int>(cycles.size());
  // The fusion sweep runs at the first cycle time (0 unless the user fixed it).
  for (size_t f = 0; f < fusions.size(); ++f) fusion_sweep_.push_back(static_cast<int>(f) * n_cycles);
  if (!tune_fusion_ && !tune_cycle_) done_ = true;
  // Start (and warm up) at the configured threshold when it is a candidate.
  current_ = 0;
  for (size_t i = 0; i < candidates_.size(); ++i) {
    if (candidates_[i].fusion_threshold == config.fusion_threshold &&
        candidates_[i].cycle_time_ms == cycles[0]) {
      current_ = i;
    }
  }
  if (leader_ && !config.autotune_log.empty()) {
    log_ = std::fopen(config.autotune_log.c_str(), "w");
    if (log_ == nullptr) {
      HVDMX_LOG(kWarning) << "cannot write the autotune log to '" << config.autotune_log
                          << "'; tuning goes on without it";
    } else {
      std::fprintf(log_, "fusion_threshold_bytes,cycle_time_ms,bytes_per_second,note\n");
      std::fflush(log_);
    }
  }
}

Autotuner::~Autotuner() {
  if (log_ != nullptr) std::fclose(log_);
}

void Autotuner::Log(const TunedSetting& s, double score, const char* note) {
  if (log_ == nullptr) return;
  std::fprintf(log_, "%lld,%g,%.6g,%s\n", static_cast<long long>(s.fusion_threshold),
               s.cycle_time_ms, score, note);
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

void Autotuner::NextTrial(double score) {
  const TunedSetting& tried = candidates_[current_];
  if (phase_ == 0) {
    Log(tried, score, "warm-up");
    phase_ = tune_fusion_ ? 1 : 2;
    if (phase_ == 2) {
      for (size_t i = 0; i < candidates_.size(); ++i) cycle_sweep_.push_back(static_cast<int>(i));
    }
    position_ = 0;
  } else {
    Log(tried, score, "trial");
    if (score > best_score_) {
      best_score_ = score;
      best_ = static_cast<int>(current_);
    }
    ++position_;
    const std::vector<int>& sweep = phase_ == 1 ? fusion_sweep_ : cycle_sweep_;
    if (position_ >= sweep.size()) {
      if (phase_ == 1 && tune_cycle_) {
        // Cycle sweep at the best threshold; its cycle-0 trial is done.
        const int n_cycles = static_cast<int>(std::size(kCycleCandidates));
        const int row = best_ / n_cycles * n_cycles;
        for (int c = 1; c < n_cycles; ++c) cycle_sweep_.push_back(row + c);
        phase_ = 2;
        position_ = 0;
      } else {
        phase_ = 3;
        done_ = true;
        current_ = best_;
        Log(candidates_[best_], best_score_, "chosen");
        HVDMX_LOG(kInfo) << "autotune chose fusion_threshold=" << candidates_[best_].fusion_threshold
                         << " cycle_time_ms=" << candidates_[best_].cycle_time_ms;
        return;
      }
    }
  }
  const std::vector<int>& sweep = phase_ == 1 ? fusion_sweep_ : cycle_sweep_;
  current_ = sweep[position_];
  started_set_ = false;
}

}  // namespace hvdmx
