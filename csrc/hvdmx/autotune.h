// Online tuning of the fusion threshold and the cycle time (HVDMX_AUTOTUNE).
//
// Note [Autotune]
// ~~~~~~~~~~~~~~~
// Rank 0 runs a sequence of trials, one setting each, and scores a trial by
// the bytes the collectives moved per second of wall time since the trial
// began: for a training loop that is proportional to steps per second, so
// it counts compute, negotiation and transfer alike. It first sweeps the
// fusion thresholds at the starting cycle time, then the cycle times at the
// best threshold, and keeps the best setting found (ties go to the earlier,
// i.e. smaller, value). A dimension the user fixed through its environment
// variable is not swept. The first trial only warms up (caches, allocations)
// and is not scored.
//
// Every rank applies rank 0's setting in step: the setting travels in one
// word of each round's bitwise AND (rank 0 contributes it, the others all
// ones; see EncodeSetting), so all ranks plan the same fusion in the same
// round, whatever their own environment says.
//
// Threading: the runtime's background thread only.
#ifndef HVDMX_AUTOTUNE_H_
#define HVDMX_AUTOTUNE_H_

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "env_config.h"

namespace hvdmx {

struct TunedSetting {
  int64_t fusion_threshold;
  double cycle_time_ms;
};

// One 64-bit word: bit 63 clear, the threshold in bits 0-47, the cycle time
// in 10 us units in bits 48-62. All ones (any rank's contribution when rank
// 0 is not tuning) decodes to nothing.
uint64_t EncodeSetting(const TunedSetting& setting);
bool DecodeSetting(uint64_t word, TunedSetting* out);

class Autotuner {
 public:
  using Clock = std::chrono::steady_clock;

  // The candidate settings are derived from `config` and are the same on
  // every rank; only rank 0 (`leader`) scores trials and writes the log.
  Autotuner(const Config& config, bool leader);
  ~Autotuner();

  const std::vector<TunedSetting>& candidates() const { return candidates_; }
  // The setting rank 0 wants used now.
  const TunedSetting& current() const { return candidates_[current_]; }
  bool done() const { return done_; }
  // Rank 0: after a round that moved `bytes`; may move to the next trial.
  void RoundDone(int64_t bytes, Clock::time_point now);

  // A trial lasts at least this long and this many rounds with work.
  static constexpr double kTrialSeconds = 0.4;
  static constexpr int kTrialRounds = 10;

 private:
  void NextTrial(double score);
  void Log(const TunedSetting& s, double score, const char* note);

  std::vector<TunedSetting> candidates_;
  std::vector<int> fusion_sweep_;  // indices of the first sweep
  std::vector<int> cycle_sweep_;   // filled once the first sweep is done
  int phase_ = 0;                  // 0: warm-up, 1: fusion sweep, 2: cycle sweep, 3: done
  size_t position_ = 0;            // within the current sweep
  uint64_t current_ = 0;
  bool done_ = false;
  bool leader_;
  bool tune_fusion_;
  bool tune_cycle_;
  double best_score_ = -1;
  int best_ = 0;
  int64_t bytes_ = 0;
  int rounds_ = 0;
  Clock::time_point started_;
  bool started_set_ = false;
  std::FILE* log_ = nullptr;
};

}  // namespace hvdmx

#endif  // HVDMX_AUTOTUNE_H_
