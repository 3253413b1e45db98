#include "platform/cpu_binding.h"

#include <dirent.h>
#include <sched.h>
#include <sys/types.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <thread>

namespace hvdmx {
namespace {

struct Binding {
  std::mutex mu;
  std::atomic<int> cpu{-1};         // bound to this CPU, or -1
  std::atomic<int> cpus_before{0};  // CPUs the process had before (when bound)
  cpu_set_t before;                 // the affinity to give back
};

Binding& State() {
  static Binding* b = new Binding();  // never destroyed: threads may outlive exit
  return *b;
}

std::vector<int> Members(const cpu_set_t& set) {
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

// Calls fn(tid) for every thread of this process.
template <typename F>
void ForEachThread(F fn) {
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return;
  while (dirent* entry = readdir(dir)) {
    char* end = nullptr;
    const long tid = std::strtol(entry->d_name, &end, 10);
    if (end == entry->d_name || *end != '\0' || tid <= 0) continue;
    fn(static_cast<pid_t>(tid));
  }
  closedir(dir);
}

}  // namespace

std::string CpuBindName(CpuBind mode) {
  switch (mode) {
    case CpuBind::kAuto: return "auto";
    case CpuBind::kCore: return "core";
    case CpuBind::kNone: return "none";
  }
  return "?";
}

std::vector<int> CurrentCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return {};
  return Members(set);
}

int ChooseCpu(CpuBind mode, const std::vector<int>& cpus, int local_rank, int local_size,
              bool same_cpus_on_host) {
  if (mode == CpuBind::kNone || cpus.size() < 2 || local_rank < 0) return -1;
  const int n = static_cast<int>(cpus.size());
  if (mode == CpuBind::kAuto && (!same_cpus_on_host || local_size < n)) return -1;
  return cpus[static_cast<size_t>(local_rank % n)];
}

int BindAllThreads(int cpu) {
  UnbindAllThreads();
  Binding& b = State();
  std::lock_guard<std::mutex> lock(b.mu);
  cpu_set_t before;
  CPU_ZERO(&before);
  if (cpu < 0 || cpu >= CPU_SETSIZE || sched_getaffinity(0, sizeof(before), &before) != 0) {
    return 0;
  }
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpu, &one);
  int bound = 0;
  // A thread may exit between the listing and the call: it is skipped.
  ForEachThread([&](pid_t tid) {
    if (sched_setaffinity(tid, sizeof(one), &one) == 0) ++bound;
  });
  if (bound == 0) return 0;
  b.before = before;
  b.cpus_before.store(CPU_COUNT(&before));
  b.cpu.store(cpu);
  return bound;
}

int UnbindAllThreads() {
  Binding& b = State();
  std::lock_guard<std::mutex> lock(b.mu);
  const int cpu = b.cpu.load();
  if (cpu < 0) return 0;
  int restored = 0;
  // Only threads whose affinity is still exactly that CPU: one the user
  // pinned elsewhere since keeps its pinning.
  ForEachThread([&](pid_t tid) {
    cpu_set_t now;
    CPU_ZERO(&now);
    if (sched_getaffinity(tid, sizeof(now), &now) != 0) return;
    if (CPU_COUNT(&now) != 1 || !CPU_ISSET(cpu, &now)) return;
    if (sched_setaffinity(tid, sizeof(b.before), &b.before) == 0) ++restored;
  });
  b.cpu.store(-1);
  return restored;
}

int BoundCpu() { return State().cpu.load(); }

int UsableCpuCount() {
  if (BoundCpu() >= 0) return State().cpus_before.load();
  const std::vector<int> cpus = CurrentCpus();
  if (!cpus.empty()) return static_cast<int>(cpus.size());
  return static_cast<int>(std::thread::hardware_concurrency());
}

}  // namespace hvdmx
