// Online tuning of the fusion threshold, the cycle time and the allreduce
// algorithm (HVDMX_AUTOTUNE).
//
// Note [Autotune]
// ~~~~~~~~~~~~~~~
// Rank 0 runs a sequence of trials, one setting each, and scores a trial by
// the bytes the collectives moved per second of wall time since the trial
// began: for a training loop that is proportional to steps per second, so
// it counts compute, negotiation and transfer alike. It sweeps one
// dimension at a time, the others held at the best values so far: the
// fusion thresholds, then the cycle times, then the algorithms (auto, shm,
// ring, mpi). The search starts from the configured values (the defaults
// unless the user set them). A dimension the user fixed through its
// environment variable (HVDMX_ALLREDUCE_ALGO or HVDMX_HIERARCHICAL_ALLREDUCE
// for the algorithm) is not swept. The first trial only warms up (caches,
// allocations) and is not scored.
//
// A machine's load drifts and bursts over seconds, by more than the
// differences being measured (docs/benchmark-notes.md, "Autotune against a
// grid search"). So a sweep runs its
// values kPasses times, interleaved (a, b, c, a, b, c, ...), the current
// best value among them, and scores each value by the median of its
// passes: a burst spoils one pass, and drift hits every value alike. The
// best value so far is kept unless another value's worst pass beats its
// best pass by more than kMargin (settings that differ less than the noise
// are not worth moving for; measured: docs/benchmark-notes.md, "Autotune
// against a grid search"); among those
// that do, the highest median wins (ties: the earlier value).
//
// Every rank applies rank 0's setting in step: the setting travels in one
// word of each round's bitwise AND (rank 0 contributes it, the others all
// ones; see EncodeSetting), so all ranks plan the same fusion in the same
// round, whatever their own environment says.
//
// Threading: the runtime's background thread only.
#ifndef HVDMX_AUTOTUNE_H_
#define HVDMX_AUTOTUNE_H_

#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "config/env_config.h"

namespace hvdmx {

struct TunedSetting {
  int64_t fusion_threshold;
  double cycle_time_ms;
  AllreduceAlgo algo;
};

// One 64-bit word: bit 63 clear, the threshold in bits 0-43, the algorithm
// in bits 44-47, the cycle time in 10 us units in bits 48-62. All ones (any
// rank's contribution when rank 0 is not tuning) decodes to nothing.
uint64_t EncodeSetting(const TunedSetting& setting);
bool DecodeSetting(uint64_t word, TunedSetting* out);

class Autotuner {
 public:
  using Clock = std::chrono::steady_clock;

  // The candidate values are derived from `config`; only rank 0 (`leader`)
  // scores trials and writes the log.
  Autotuner(const Config& config, bool leader);
  ~Autotuner();

  // The setting rank 0 wants used now.
  TunedSetting current() const { return Setting(current_); }
  bool done() const { return done_; }
  // Rank 0: after a round that moved `bytes`; may move to the next trial.
  void RoundDone(int64_t bytes, Clock::time_point now);

  // A trial lasts at least this long and this many rounds with work.
  static constexpr double kTrialSeconds = 0.25;
  static constexpr int kTrialRounds = 8;
  // See Note [Autotune].
  static constexpr int kPasses = 3;
  static constexpr double kMargin = 0.02;

 private:
  static constexpr int kDims = 3;  // fusion threshold, cycle time, algorithm
  // A point of the grid: an index into each dimension's values.
  using Point = std::array<int, kDims>;

  TunedSetting Setting(const Point& p) const;
  // Starts the sweep of the next dimension with more than one value, or
  // ends the search.
  void NextSweep();
  // Ends a sweep: moves best_ to the value its scores favour.
  void EndSweep();
  void NextTrial(double score);
  void Log(const TunedSetting& s, double score, const char* note);

  std::vector<int64_t> fusions_;
  std::vector<double> cycles_;
  std::vector<AllreduceAlgo> algos_;
  int dim_ = -1;                                   // the dimension being swept; -1: warm-up
  std::vector<Point> sweep_;                       // its values, once each
  std::vector<std::vector<double>> sweep_scores_;  // per value, one per pass
  size_t position_ = 0;                            // trials of the sweep so far (all passes)
  Point current_{};
  bool done_ = false;
  bool leader_;
  double best_score_ = -1;  // best_'s median, for the log
  Point best_{};
  int64_t bytes_ = 0;
  int rounds_ = 0;
  Clock::time_point started_;
  bool started_set_ = false;
  std::FILE* log_ = nullptr;
};

}  // namespace hvdmx

#endif  // HVDMX_AUTOTUNE_H_
