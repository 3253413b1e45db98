#include "base/timeline.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <sstream>

namespace hvdmx {
namespace {

// JSON string contents for `text` (tensor names are the user's).
std::string Escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out;
}

bool WriteAt(int fd, const std::string& data, int64_t offset) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = pwrite(fd, data.data() + done, data.size() - done, offset + done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += n;
  }
  return true;
}

constexpr char kCycleRow[] = "negotiation rounds";

}  // namespace

Timeline& ProcessTimeline() {
  static Timeline* timeline = new Timeline();  // engine threads may outlive main
  return *timeline;
}

Status Timeline::Start(const std::string& path, bool mark_cycles) {
  Stop();
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    return Status::InvalidArgument("hvdmx: cannot write the timeline to '" + path + "': " +
                                   std::strerror(errno) + "; give a path in a writable directory");
  }
  const std::string head = "[\n]";
  if (!WriteAt(fd, head, 0)) {
    close(fd);
    return Status::InvalidArgument("hvdmx: cannot write the timeline to '" + path + "'");
  }
  fd_ = fd;
  end_ = 2;  // the "]"
  first_event_ = true;
  rows_.clear();
  origin_ = Clock::now();
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = false;
    pending_.clear();
  }
  mark_cycles_ = mark_cycles;
  writer_ = std::thread([this] { WriterLoop(); });
  enabled_ = true;
  return Status::Ok();
}

void Timeline::Stop() {
  if (!writer_.joinable()) return;
  enabled_ = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_one();
  writer_.join();
  close(fd_);
  fd_ = -1;
}

void Timeline::Record(Event event) {
  std::lock_guard<std::mutex> lock(mu_);
  pending_.push_back(std::move(event));
}

void Timeline::Phase(const std::string& tensor, const char* phase, Clock::time_point start,
                     Clock::time_point end, std::string args) {
  if (!enabled()) return;
  using std::chrono::duration_cast;
  using std::chrono::microseconds;
  // Both ends rounded the same way, so that a step inside an operation is
  // inside it in whole microseconds too (Note [Timeline names] in executor.cc).
  const int64_t from = duration_cast<microseconds>(start - origin_).count();
  const int64_t to = duration_cast<microseconds>(end - origin_).count();
  Record(Event{tensor, phase, std::move(args), 'X', from, std::max<int64_t>(0, to - from)});
}

void Timeline::Mark(const std::string& tensor, std::string what, Clock::time_point at) {
  if (!enabled()) return;
  Record(Event{tensor, std::move(what), std::string(), 'i',
               std::chrono::duration_cast<std::chrono::microseconds>(at - origin_).count(), 0});
}

void Timeline::Cycle(Clock::time_point at) {
  if (!mark_cycles()) return;
  Mark(kCycleRow, "CYCLE_START", at);
}

void Timeline::WriterLoop() {
  std::vector<Event> batch;
  while (true) {
    bool stopping;
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait_for(lock, std::chrono::milliseconds(100), [this] { return stop_; });
      batch.swap(pending_);
      stopping = stop_;
    }
    if (!batch.empty()) Write(batch);
    batch.clear();
    if (stopping) return;
  }
}

void Timeline::Write(std::vector<Event>& events) {
  std::ostringstream out;
  auto separator = [&] {
    out << (first_event_ ? "" : ",\n");
    first_event_ = false;
  };
  for (const Event& e : events) {
    auto row = rows_.find(e.tensor);
    if (row == rows_.end()) {
      const int id = static_cast<int>(rows_.size()) + 1;
      row = rows_.emplace(e.tensor, id).first;
      separator();
      out << "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": " << id
          << ", \"args\": {\"name\": \"" << Escape(e.tensor) << "\"}},\n"
          << "{\"name\": \"process_sort_index\", \"ph\": \"M\", \"pid\": " << id
          << ", \"args\": {\"sort_index\": " << id << "}}";
    }
    separator();
    out << "{\"name\": \"" << Escape(e.what) << "\", \"ph\": \"" << e.kind
        << "\", \"pid\": " << row->second << ", \"tid\": 0, \"ts\": " << e.ts_us;
    if (e.kind == 'X') out << ", \"dur\": " << e.dur_us;
    if (e.kind == 'i') out << ", \"s\": \"p\"";
    if (!e.args.empty()) out << ", \"args\": {" << e.args << "}";
    out << "}";
  }
  std::string data = out.str();
  // Replace the closing "]" with the events and a new "]" in one write, so
  // the file parses whenever the process stops.
  data += "\n]";
  if (WriteAt(fd_, data, end_)) end_ += static_cast<int64_t>(data.size()) - 1;
}

}  // namespace hvdmx
