#include "capture.h"

#include <ATen/record_function.h>
#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/csrc/profiler/orchestration/observer.h>

#include <atomic>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#ifdef MEMPROF_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace memprof {
namespace {

class Reporter;

struct Session {
  explicit Session(size_t max_events) : store(max_events) {}
  uint64_t generation = 0;
  EventStore store;
  StringTable strings;
  std::atomic<bool> active{true};
  std::shared_ptr<Reporter> reporter;
  at::CallbackHandle handle = 0;
  std::thread::id owner;
  int64_t t_start = 0;
  int64_t t_stop = 0;
};

// Sessions are never deleted (their event memory is freed by release()), so a
// callback racing with stop_capture() or interpreter exit never touches freed
// memory. Only the small Session object itself is leaked per capture.
std::atomic<Session*> g_active{nullptr};
std::atomic<bool> g_shutdown{false};
Session* g_last = nullptr;
std::mutex g_control_mu;
uint64_t g_generation = 0;

// Per-thread state. Heap-allocated and leaked so callbacks that fire during
// thread or process teardown never see a destroyed thread_local.
struct ThreadState {
  uint64_t generation = 0;
  std::vector<uint32_t> stack;           // open RecordFunction scopes
  std::deque<std::string> owned;         // storage for cache keys
  std::unordered_map<std::string_view, uint32_t> cache;  // name -> id
  // CUDA tracker ALLOC seen just before the reporter's ALLOC (same thread,
  // same allocator lock): requested size and stream to merge into it.
  bool pending_valid = false;
  uint64_t pending_ptr = 0;
  int64_t pending_requested = -1;
  uint64_t pending_stream = 0;
};

ThreadState& thread_state(const Session* s) {
  thread_local ThreadState* ts = new ThreadState();
  if (ts->generation != s->generation) {
    ts->generation = s->generation;
    ts->stack.clear();
    ts->cache.clear();
    ts->owned.clear();
    ts->pending_valid = false;
  }
  return *ts;
}

uint32_t intern_cached(Session* s, ThreadState& ts, const char* name) {
  std::string_view sv(name ? name : "");
  auto it = ts.cache.find(sv);
  if (it != ts.cache.end()) return it->second;
  const uint32_t id = s->strings.intern(sv);
  ts.owned.emplace_back(sv);
  ts.cache.emplace(std::string_view(ts.owned.back()), id);
  return id;
}

Event make_event(uint8_t kind, const ThreadState& ts) {
  Event e{};
  e.t_ns = now_ns();
  e.kind = kind;
  e.aux = -1;
  e.device_type = -1;
  e.device_index = -1;
  e.scope = ts.stack.empty() ? 0 : ts.stack.back();
  e.thread = static_cast<uint16_t>(current_thread_index());
  return e;
}

// The reporter sits in the PROFILER_STATE debug-info slot. Deriving from
// ProfilerStateBase (state Disabled) keeps profiler code that reads that slot
// well-defined while c10::memoryProfilingEnabled() returns true.
class Reporter final : public torch::profiler::impl::ProfilerStateBase {
 public:
  explicit Reporter(Session* s)
      : ProfilerStateBase(torch::profiler::impl::ProfilerConfig(
            torch::profiler::impl::ProfilerState::Disabled)),
        session_(s) {}

  void reportMemoryUsage(void* ptr, int64_t alloc_size, size_t /*total_allocated*/,
                         size_t /*total_reserved*/, c10::Device device) override {
    Session* s = session_;
    if (!s->active.load(std::memory_order_relaxed) || alloc_size == 0) return;
    ThreadState& ts = thread_state(s);
    Event e = make_event(alloc_size > 0 ? kAlloc : kFree, ts);
    e.bytes = alloc_size;
    e.ptr = reinterpret_cast<uint64_t>(ptr);
    e.device_type = static_cast<int8_t>(device.type());
    e.device_index = static_cast<int8_t>(device.index());
    if (alloc_size > 0 && ts.pending_valid && ts.pending_ptr == e.ptr) {
      e.aux = ts.pending_requested;
      e.stream = ts.pending_stream;
      ts.pending_valid = false;
    }
    s->store.append(e);
  }

  void reportOutOfMemory(int64_t alloc_size, size_t /*total_allocated*/,
                         size_t /*total_reserved*/, c10::Device device) override {
    Session* s = session_;
    if (!s->active.load(std::memory_order_relaxed)) return;
    // On CUDA builds with the tracker attached, the tracker records the OOM
    // (with the device's free bytes); record it here otherwise.
    if (device.is_cuda() && cuda_tracker_attached()) return;
    ThreadState& ts = thread_state(s);
    Event e = make_event(kOom, ts);
    e.bytes = alloc_size;
    e.device_type = static_cast<int8_t>(device.type());
    e.device_index = static_cast<int8_t>(device.index());
    s->store.append(e);
  }

  bool memoryProfilingEnabled() const override { return true; }

  torch::profiler::impl::ActiveProfilerType profilerType() override {
    return torch::profiler::impl::ActiveProfilerType::NONE;
  }

 private:
  Session* session_;
};

std::unique_ptr<at::ObserverContext> on_scope_enter(const at::RecordFunction& fn) {
  Session* s = g_active.load(std::memory_order_acquire);
  if (s == nullptr) return nullptr;
  ThreadState& ts = thread_state(s);
  const uint32_t id = intern_cached(s, ts, fn.name());
  Event e = make_event(kScopeBegin, ts);
  e.scope = id;
  ts.stack.push_back(id);
  s->store.append(e);
  return nullptr;
}

void on_scope_exit(const at::RecordFunction& fn, at::ObserverContext* /*ctx*/) {
  Session* s = g_active.load(std::memory_order_acquire);
  if (s == nullptr) return;
  ThreadState& ts = thread_state(s);
  const uint32_t id = intern_cached(s, ts, fn.name());
  // Scopes close in LIFO order on a thread; tolerate an end whose begin was
  // not seen (it started before the capture) by ignoring it.
  for (size_t i = ts.stack.size(); i > 0; --i) {
    if (ts.stack[i - 1] == id) {
      ts.stack.resize(i - 1);
      Event e = make_event(kScopeEnd, ts);
      e.scope = id;
      s->store.append(e);
      return;
    }
  }
}

void append_marker(uint8_t kind, int64_t value, std::string_view label) {
  Session* s = g_active.load(std::memory_order_acquire);
  if (s == nullptr) return;
  ThreadState& ts = thread_state(s);
  Event e = make_event(kind, ts);
  e.bytes = value;
  if (!label.empty()) e.scope = s->strings.intern(label);
  s->store.append(e);
}

#ifdef MEMPROF_WITH_CUDA
std::atomic<bool> g_tracker_attached{false};

void on_cuda_trace(const c10::CachingDeviceAllocator::TraceEntry& te) {
  // Runs under the device allocator's lock, possibly with the GIL held:
  // no Python, no torch calls, no allocator calls.
  if (g_shutdown.load(std::memory_order_relaxed)) return;
  Session* s = g_active.load(std::memory_order_acquire);
  if (s == nullptr) return;
  using Action = c10::CachingDeviceAllocator::TraceEntry::Action;
  const bool followed =
      c10::ThreadLocalDebugInfo::get(c10::DebugInfoKind::PROFILER_STATE) ==
      static_cast<c10::DebugInfoBase*>(s->reporter.get());
  ThreadState& ts = thread_state(s);
  const auto stream = reinterpret_cast<uint64_t>(te.stream_);
  auto emit = [&](uint8_t kind, int64_t bytes, int64_t aux) {
    Event e = make_event(kind, ts);
    e.bytes = bytes;
    e.ptr = static_cast<uint64_t>(te.addr_);
    e.stream = stream;
    e.aux = aux;
    e.device_type = static_cast<int8_t>(c10::DeviceType::CUDA);
    e.device_index = static_cast<int8_t>(te.device_);
    if (!followed) e.flags |= kFlagUnfollowedThread;
    s->store.append(e);
  };
  const auto size = static_cast<int64_t>(te.size_);
  switch (te.action_) {
    case Action::ALLOC:
      if (followed) {
        ts.pending_valid = true;
        ts.pending_ptr = static_cast<uint64_t>(te.addr_);
        ts.pending_requested = size;
        ts.pending_stream = stream;
      } else {
        emit(kCudaAlloc, size, size);
      }
      break;
    case Action::FREE_REQUESTED:
      if (!followed) emit(kCudaFreeRequested, -size, size);
      break;
    case Action::SEGMENT_ALLOC:
      emit(kSegmentAlloc, size, -1);
      break;
    case Action::SEGMENT_FREE:
      emit(kSegmentFree, -size, -1);
      break;
    case Action::SEGMENT_MAP:
      emit(kSegmentMap, size, -1);
      break;
    case Action::SEGMENT_UNMAP:
      emit(kSegmentUnmap, -size, -1);
      break;
    case Action::OOM: {
      Event e = make_event(kOom, ts);
      e.bytes = size;
      e.aux = static_cast<int64_t>(te.addr_);  // free bytes on the device
      e.stream = stream;
      e.device_type = static_cast<int8_t>(c10::DeviceType::CUDA);
      e.device_index = static_cast<int8_t>(te.device_);
      s->store.append(e);
      break;
    }
    default:
      break;
  }
}
#endif

}  // namespace

void start_capture(const CaptureOptions& options) {
  std::lock_guard<std::mutex> lock(g_control_mu);
  if (g_shutdown.load()) throw std::runtime_error("memprof is shut down (interpreter exiting)");
  if (g_active.load() != nullptr) throw std::runtime_error("a memprof capture is already active");
  if (torch::profiler::impl::ProfilerStateBase::get(/*global=*/false) != nullptr ||
      torch::profiler::impl::ProfilerStateBase::get(/*global=*/true) != nullptr) {
    throw std::runtime_error(
        "torch.profiler is active on this thread; memprof and torch.profiler share "
        "PyTorch's profiler slot, so stop the profiler before capturing");
  }
  auto* s = new Session(options.max_events);
  s->generation = ++g_generation;
  s->owner = std::this_thread::get_id();
  s->reporter = std::make_shared<Reporter>(s);
  c10::ThreadLocalDebugInfo::_push(c10::DebugInfoKind::PROFILER_STATE, s->reporter);
  std::unordered_set<at::RecordScope, std::hash<at::RecordScope>> scopes;
  if (options.scope_bits & kScopeFunction) scopes.insert(at::RecordScope::FUNCTION);
  if (options.scope_bits & kScopeBackward) scopes.insert(at::RecordScope::BACKWARD_FUNCTION);
  if (options.scope_bits & kScopeUser) scopes.insert(at::RecordScope::USER_SCOPE);
  if (!scopes.empty()) {
    s->handle = at::addThreadLocalCallback(
        at::RecordFunctionCallback(&on_scope_enter, &on_scope_exit).scopes(scopes));
  }
  Session* previous = g_last;
  g_last = s;
  if (previous != nullptr) previous->store.clear();
  s->t_start = now_ns();
  g_active.store(s, std::memory_order_release);
}

std::string stop_capture() {
  std::lock_guard<std::mutex> lock(g_control_mu);
  Session* s = g_active.load();
  if (s == nullptr) throw std::runtime_error("no memprof capture is active");
  if (s->owner != std::this_thread::get_id()) {
    throw std::runtime_error("a capture must be stopped on the thread that started it");
  }
  g_active.store(nullptr, std::memory_order_release);
  s->active.store(false);
  s->t_stop = now_ns();
  if (s->handle != 0) at::removeCallback(s->handle);
  std::string warning;
  auto* top = c10::ThreadLocalDebugInfo::get(c10::DebugInfoKind::PROFILER_STATE);
  if (top == static_cast<c10::DebugInfoBase*>(s->reporter.get())) {
    try {
      c10::ThreadLocalDebugInfo::_pop(c10::DebugInfoKind::PROFILER_STATE);
    } catch (const std::exception& e) {
      warning = std::string("could not remove memprof's reporter cleanly: ") + e.what();
    }
  } else {
    warning = "memprof's reporter was not the innermost profiler state at stop; left in place (inactive)";
  }
  return warning;
}

bool capture_active() { return g_active.load() != nullptr; }

size_t event_count() { return g_last ? g_last->store.size() : 0; }
size_t copy_events(Event* dst, size_t capacity) {
  return g_last ? g_last->store.copy_to(dst, capacity) : 0;
}
std::vector<std::string> strings() {
  return g_last ? g_last->strings.snapshot() : std::vector<std::string>{""};
}
uint64_t dropped_events() { return g_last ? g_last->store.dropped() : 0; }
size_t max_events() { return g_last ? g_last->store.max_events() : 0; }
int64_t capture_start_ns() { return g_last ? g_last->t_start : 0; }
int64_t capture_stop_ns() { return g_last ? g_last->t_stop : 0; }

void release() {
  std::lock_guard<std::mutex> lock(g_control_mu);
  if (g_last != nullptr && g_active.load() != g_last) g_last->store.clear();
}

void mark_step(int64_t step) { append_marker(kStep, step, ""); }
void mark(std::string_view label) { append_marker(kMark, 0, label); }

bool cuda_built() {
#ifdef MEMPROF_WITH_CUDA
  return true;
#else
  return false;
#endif
}

std::string attach_cuda_tracker() {
#ifdef MEMPROF_WITH_CUDA
  std::lock_guard<std::mutex> lock(g_control_mu);
  if (g_tracker_attached.load()) return "";
  try {
    c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker(&on_cuda_trace);
  } catch (const std::exception& e) {
    std::string what = e.what();
    auto nl = what.find('\n');
    return nl == std::string::npos ? what : what.substr(0, nl);
  }
  g_tracker_attached.store(true);
  return "";
#else
  return "memprof was built without CUDA support";
#endif
}

bool cuda_tracker_attached() {
#ifdef MEMPROF_WITH_CUDA
  return g_tracker_attached.load();
#else
  return false;
#endif
}

void shutdown() {
  g_shutdown.store(true);
  Session* s = g_active.exchange(nullptr);
  if (s != nullptr) s->active.store(false);
}

}  // namespace memprof
