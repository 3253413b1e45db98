// Rank-prefixed log lines on stderr, filtered by HVDMX_LOG_LEVEL.
// Any thread may log; each line is written with one fwrite so lines from
// different threads do not interleave.
#ifndef HVDMX_LOGGING_H_
#define HVDMX_LOGGING_H_

#include <sstream>
#include <string>

namespace hvdmx {

enum class LogLevel : int { kTrace = 0, kDebug, kInfo, kWarning, kError, kFatal };

// Parses "trace", "debug", "info", "warning", "error", "fatal" (any case).
bool ParseLogLevel(const std::string& text, LogLevel* out);
void SetLogLevel(LogLevel level);
LogLevel GetLogLevel();
// The rank printed in front of every line; -1 before init.
void SetLogRank(int rank);

class LogLine {
 public:
  explicit LogLine(LogLevel level) : level_(level) {}
  ~LogLine();
  std::ostringstream& stream() { return out_; }

 private:
  LogLevel level_;
  std::ostringstream out_;
};

}  // namespace hvdmx

#define HVDMX_LOG(level)                                   \
  if (::hvdmx::LogLevel::level < ::hvdmx::GetLogLevel()) { \
  } else                                                   \
    ::hvdmx::LogLine(::hvdmx::LogLevel::level).stream()

#endif  // HVDMX_LOGGING_H_
