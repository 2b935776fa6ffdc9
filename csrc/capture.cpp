#include "capture.h"
#include "signals.h"

#include <ATen/record_function.h>
#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <c10/util/flat_hash_map.h>
#include <torch/csrc/profiler/orchestration/observer.h>

#include <array>
#include <atomic>
#include <cstring>
#include <deque>
#include <mutex>
#include <string_view>
#include <stdexcept>
#include <thread>

#include <pthread.h>
#include <unordered_map>
#include <unordered_set>

#ifdef MEMPROF_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace memprof {
namespace {

// The thread-locals every event reads. In a shared library each access is otherwise a call to
// __tls_get_addr (three to five an allocation and its free); the initial-exec model makes it one
// load from the thread pointer. It takes these few bytes from the static TLS space glibc keeps
// for libraries loaded later (dlopen), which is hundreds of bytes.
#if defined(__GNUC__) && defined(__ELF__)
#define MEMPROF_HOT_TLS __attribute__((tls_model("initial-exec")))
#else
#define MEMPROF_HOT_TLS
#endif

class Reporter;

// Set while the CPU allocator wrapper calls into the allocator it wraps: the default CPU
// allocator then reports the same allocation or free to the thread's Reporter, which must
// not record it a second time.
MEMPROF_HOT_TLS thread_local bool t_in_cpu_wrapper = false;

struct Session {
  explicit Session(const CaptureOptions& o) : store(StoreOptions{o.max_events, o.first_step, o.last_step, o.keep_last}) {}
  uint64_t generation = 0;
  EventStore store;
  StringTable strings;
  std::atomic<bool> active{true};
  std::shared_ptr<Reporter> reporter;
  at::CallbackHandle handle = 0;
  std::thread::id owner;
  int64_t t_start = 0;
  int64_t t_stop = 0;
  std::string cpu_wrapper_problem;  // "" when CPU allocations are seen on every thread
  // The CPU allocator wrapper records CPU allocations itself: the reporter then tells torch that
  // memory profiling is off, so the default CPU allocator skips its own size table (a mutex and a
  // map insert per allocation, and the same again per free) and reports nothing the reporter would
  // only drop. The CUDA caching allocator reports to the reporter whatever this says.
  std::atomic<bool> cpu_wrapped{false};
};

// Sessions are never deleted (their event memory is freed by release()), so a
// callback racing with stop_capture() or interpreter exit never touches freed
// memory. Only the small Session object itself is leaked per capture.
std::atomic<Session*> g_active{nullptr};
std::atomic<bool> g_shutdown{false};
// The session whose results are read (the spill's thread reads them while start_capture replaces it)
std::atomic<Session*> g_last{nullptr};
std::mutex g_control_mu;
uint64_t g_generation = 0;

// Per-thread state. Heap-allocated and leaked so callbacks that fire during
// thread or process teardown never see a destroyed thread_local.
struct ThreadState {
  uint64_t generation = 0;
  std::vector<uint32_t> stack;           // open scopes (RecordFunction's and memprof's own), innermost last
  // An op's scope is recorded only once an event happens inside it: the stack's first `written` scopes
  // have their begin in the store, those above them wait for the thread's next event (`flush_scopes`).
  // Most ops allocate nothing (in-place updates, views, an optimizer's arithmetic), and their two
  // events were most of what op scopes cost a host-bound step. Scopes that are not an op's, and every
  // scope inside a compiled-graph call (the join counts the wrapper's calls there by occurrence) or a
  // collective (`memprof.analysis.distributed` finds them by name), are written when they begin.
  size_t written = 0;
  uint32_t graph_calls = 0;              // compiled-graph call scopes open on the stack
  std::deque<std::string> owned;         // storage for cache keys
  std::unordered_map<std::string_view, uint32_t> cache;  // name -> id
  // CUDA tracker ALLOC seen just before the reporter's ALLOC (same thread,
  // same allocator lock): requested size and stream to merge into it.
  bool pending_valid = false;
  uint64_t pending_ptr = 0;
  int64_t pending_requested = -1;
  uint64_t pending_stream = 0;
  uint32_t thread_index = 0;  // current_thread_index(), kept here: one thread-local lookup an event
  // The last scope name seen at each of a few addresses, with its id: RecordFunction names an
  // op by its schema's string, at one address for the process, so a scope's name is found by its
  // address and one strcmp against the copy kept (which also catches an address reused for another
  // name), where hashing the whole name and comparing it in the cache cost as much as the clock.
  struct NameSlot {
    const char* address = nullptr;
    const char* copy = nullptr;  // the name as interned (ts.owned), NUL-terminated
    uint32_t id = 0;
  };
  static constexpr size_t kNameSlots = 256;
  std::array<NameSlot, kNameSlots> by_address{};
};

// (constant-initialized, unlike a function's thread_local with an initializer: no guard to check on
// each access)
MEMPROF_HOT_TLS thread_local ThreadState* t_state = nullptr;

// A thread's first event, or its first of a new capture (kept out of line: the path every event
// takes stays a load and a compare).
[[gnu::noinline]] ThreadState& new_thread_state(const Session* s) {
  ThreadState* ts = t_state;
  if (ts == nullptr) {
    ts = new ThreadState();
    ts->thread_index = current_thread_index();
    t_state = ts;
  }
  if (ts->generation != s->generation) {
    ts->generation = s->generation;
    ts->stack.clear();
    ts->written = 0;
    ts->graph_calls = 0;
    ts->cache.clear();
    ts->owned.clear();
    ts->by_address.fill(ThreadState::NameSlot{});
    ts->pending_valid = false;
  }
  return *ts;
}

inline ThreadState& thread_state(const Session* s) {
  ThreadState* ts = t_state;
  if (ts != nullptr && ts->generation == s->generation) return *ts;
  return new_thread_state(s);
}

// The id of a scope name, and the thread's copy of it (NUL-terminated, kept for the capture).
std::pair<uint32_t, const char*> intern_cached(Session* s, ThreadState& ts, std::string_view sv) {
  auto it = ts.cache.find(sv);
  if (it != ts.cache.end()) return {it->second, it->first.data()};
  const uint32_t id = s->strings.intern(sv);
  ts.owned.emplace_back(sv);
  ts.cache.emplace(std::string_view(ts.owned.back()), id);
  return {id, ts.owned.back().c_str()};
}

uint32_t scope_id(Session* s, ThreadState& ts, const char* name) {
  auto& slot = ts.by_address[(reinterpret_cast<uintptr_t>(name) >> 3) % ThreadState::kNameSlots];
  if (slot.address == name && std::strcmp(slot.copy, name) == 0) return slot.id;
  const auto [id, copy] = intern_cached(s, ts, name);
  slot = ThreadState::NameSlot{name, copy, id};
  return id;
}

// An event of the thread at `t_ns`, in the innermost scope open on it.
Event make_event_at(uint8_t kind, const ThreadState& ts, int64_t t_ns) {
  Event e{};
  e.t_ns = t_ns;
  e.kind = kind;
  e.aux = -1;
  e.device_type = -1;
  e.device_index = -1;
  e.scope = ts.stack.empty() ? 0 : ts.stack.back();
  e.thread = static_cast<uint16_t>(ts.thread_index);
  return e;
}

Event make_event(uint8_t kind, const ThreadState& ts) { return make_event_at(kind, ts, now_ns()); }

// The begins of the thread's scopes still waiting for an event (`ThreadState::written`), outermost
// first, at the time of the event about to be appended (`t_ns`, read before it: the store stays in
// time order on the thread).
[[gnu::noinline]] void flush_scopes(Session* s, ThreadState& ts, int64_t t_ns) {
  for (size_t i = ts.written; i < ts.stack.size(); ++i) {
    Event b = make_event_at(kScopeBegin, ts, t_ns);
    b.scope = ts.stack[i];
    s->store.append(b);
  }
  ts.written = ts.stack.size();
}

// Every event of a thread goes to the store through here: the scopes it happens in first.
inline void append(Session* s, ThreadState& ts, const Event& e) {
  if (ts.written != ts.stack.size()) flush_scopes(s, ts, e.t_ns);
  s->store.append(e);
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
    if (t_in_cpu_wrapper && device.is_cpu()) return;  // recorded by TrackingCPUAllocator
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
    append(s, ts, e);
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
    append(s, ts, e);
  }

  bool memoryProfilingEnabled() const override {
    return !session_->cpu_wrapped.load(std::memory_order_relaxed);
  }

  torch::profiler::impl::ActiveProfilerType profilerType() override {
    return torch::profiler::impl::ActiveProfilerType::NONE;
  }

 private:
  Session* session_;
};

// The CPU allocator, wrapped for the capture: PyTorch reports CPU allocations only to the
// profiler state of the allocating thread (thread-local), so allocations on other Python
// threads and frees of tensors handed to another thread (a data pipeline's hand-off) would be
// missed, and an address freed elsewhere would still count as live. The wrapper records every
// allocation it makes and every free of them, on any thread. The free is recorded before the
// memory is released and the allocation after it is made, so that events of one address never
// cross in the store. Its DataPtrs keep context == data (so copy-on-write and raw_allocate
// keep working), with the wrapped allocator's deleter kept in a map beside the size.
struct TrackedBlock {
  size_t size;
  c10::DeleterFnPtr deleter;
};

struct BoxedDataPtr {  // an allocation whose context is not its data pointer
  c10::DataPtr inner;
  size_t size;
};

SpinLock& tracked_mu() {  // (taken at every CPU allocation and free, as the store's lock is)
  static auto* mu = new SpinLock();  // leaked: frees can run during process teardown
  return *mu;
}
// (an open-addressing map: std::unordered_map's node per insert was a malloc and a free per tensor)
ska::flat_hash_map<void*, TrackedBlock>& tracked_blocks() {
  static auto* blocks = new ska::flat_hash_map<void*, TrackedBlock>();
  return *blocks;
}

void record_cpu(uint8_t kind, void* ptr, int64_t bytes) {
  Session* s = g_active.load(std::memory_order_acquire);
  if (s == nullptr || g_shutdown.load(std::memory_order_relaxed)) return;
  ThreadState& ts = thread_state(s);
  Event e = make_event(kind, ts);
  e.bytes = bytes;
  e.ptr = reinterpret_cast<uint64_t>(ptr);
  e.device_type = static_cast<int8_t>(c10::DeviceType::CPU);
  e.device_index = -1;
  if (c10::ThreadLocalDebugInfo::get(c10::DebugInfoKind::PROFILER_STATE) !=
      static_cast<c10::DebugInfoBase*>(s->reporter.get())) {
    e.flags |= kFlagOtherThread;
  }
  append(s, ts, e);
}

class TrackingCPUAllocator;
std::atomic<TrackingCPUAllocator*> g_cpu_wrapper{nullptr};

class TrackingCPUAllocator final : public c10::Allocator {
 public:
  explicit TrackingCPUAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr dp;
    {
      struct Flag {  // restored also when the wrapped allocator throws (out of memory)
        bool previous = t_in_cpu_wrapper;
        Flag() { t_in_cpu_wrapper = true; }
        ~Flag() { t_in_cpu_wrapper = previous; }
      } flag;
      dp = inner_->allocate(n);
    }
    void* data = dp.get();
    if (n == 0 || data == nullptr || g_active.load(std::memory_order_acquire) == nullptr) return dp;
    const c10::Device device = dp.device();
    if (dp.get_context() == data) {
      const c10::DeleterFnPtr deleter = dp.get_deleter();
      {
        std::lock_guard<SpinLock> lock(tracked_mu());
        tracked_blocks()[data] = TrackedBlock{n, deleter};
      }
      dp.release_context();
      record_cpu(kAlloc, data, static_cast<int64_t>(n));
      return c10::DataPtr(data, data, &tracked_delete, device);
    }
    auto* box = new BoxedDataPtr{std::move(dp), n};
    record_cpu(kAlloc, data, static_cast<int64_t>(n));
    return c10::DataPtr(data, box, &boxed_delete, device);
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return inner_->raw_deleter() != nullptr ? &tracked_delete : nullptr;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    inner_->copy_data(dest, src, count);
  }

  c10::Allocator* inner() const { return inner_; }

  static void tracked_delete(void* ptr) {
    TrackedBlock block{0, nullptr};
    bool found = false;
    {
      std::lock_guard<SpinLock> lock(tracked_mu());
      auto it = tracked_blocks().find(ptr);
      if (it != tracked_blocks().end()) {
        block = it->second;
        found = true;
        tracked_blocks().erase(it);
      }
    }
    if (found) record_cpu(kFree, ptr, -static_cast<int64_t>(block.size));
    c10::DeleterFnPtr deleter = block.deleter;
    if (!found) {  // raw_allocate while no capture ran: the wrapped allocator's own deleter
      TrackingCPUAllocator* w = g_cpu_wrapper.load();
      deleter = w != nullptr ? w->inner()->raw_deleter() : nullptr;
    }
    if (deleter == nullptr) return;
    const bool previous = t_in_cpu_wrapper;
    t_in_cpu_wrapper = true;
    deleter(ptr);
    t_in_cpu_wrapper = previous;
  }

  static void boxed_delete(void* ctx) {
    auto* box = static_cast<BoxedDataPtr*>(ctx);
    record_cpu(kFree, box->inner.get(), -static_cast<int64_t>(box->size));
    const bool previous = t_in_cpu_wrapper;
    t_in_cpu_wrapper = true;
    delete box;
    t_in_cpu_wrapper = previous;
  }

 private:
  c10::Allocator* inner_;
};

// Installed for each capture, uninstalled at stop (tensors it made keep working afterwards: the
// wrapper is never deleted). Returns "" or why CPU allocations on other threads are not seen.
uint8_t g_cpu_priority = 0;

std::string install_cpu_wrapper() {
  c10::Allocator* current = c10::GetAllocator(c10::DeviceType::CPU);
  TrackingCPUAllocator* w = g_cpu_wrapper.load();
  if (w != nullptr && current == w) return "";
  if (w == nullptr || w->inner() != current) {
    w = new TrackingCPUAllocator(current);
    g_cpu_wrapper.store(w);
  }
  // SetAllocator keeps an allocator registered with a higher priority: take the lowest that works.
  for (int p = 0; p <= 255; ++p) {
    c10::SetAllocator(c10::DeviceType::CPU, w, static_cast<uint8_t>(p));
    if (c10::GetAllocator(c10::DeviceType::CPU) == w) {
      g_cpu_priority = static_cast<uint8_t>(p);
      return "";
    }
  }
  return "the CPU allocator could not be wrapped";
}

void uninstall_cpu_wrapper() {
  TrackingCPUAllocator* w = g_cpu_wrapper.load();
  if (w != nullptr && c10::GetAllocator(c10::DeviceType::CPU) == w) {
    c10::SetAllocator(c10::DeviceType::CPU, w->inner(), g_cpu_priority);
  }
}

// A scope's begin on the calling thread, written now (its unwritten callers first).
[[gnu::noinline]] void write_scope_begin(Session* s, ThreadState& ts, uint32_t id) {
  Event e = make_event(kScopeBegin, ts);
  e.scope = id;
  append(s, ts, e);  // (the scopes below it first)
  ts.stack.push_back(id);
  ts.written = ts.stack.size();
}

// A scope's end on the calling thread, written where its begin was.
[[gnu::noinline]] void record_scope_end(Session* s, ThreadState& ts, uint32_t id, bool graph_call) {
  // Scopes close in LIFO order on a thread; tolerate an end whose begin was
  // not seen (it started before the capture) by ignoring it.
  for (size_t i = ts.stack.size(); i > 0; --i) {
    if (ts.stack[i - 1] == id) {
      const bool was_written = i <= ts.written;
      ts.stack.resize(i - 1);
      ts.graph_calls -= graph_call && ts.graph_calls > 0;
      if (ts.stack.empty()) ts.graph_calls = 0;  // (an end that closed a call's scope without its own)
      if (!was_written) return;  // nothing happened in it: neither end is recorded
      ts.written = i - 1;
      Event e = make_event(kScopeEnd, ts);
      e.scope = id;
      s->store.append(e);
      return;
    }
  }
}

// A scope's begin or end on the calling thread, whoever opened it (RecordFunction, or memprof itself in
// a quiet stretch: quiet_scope).
// `lazy`: an op's scope, written only once an event happens in it (`ThreadState::written`); its begin
// is then only a push (inline: most ops take this path).
inline void record_scope(Session* s, ThreadState& ts, uint32_t id, bool begin, bool lazy = false,
                         bool graph_call = false) {
  if (!begin) return record_scope_end(s, ts, id, graph_call);
  ts.graph_calls += graph_call;
  if (lazy && ts.graph_calls == 0) {
    ts.stack.push_back(id);
    return;
  }
  write_scope_begin(s, ts, id);
}

constexpr std::string_view kGraphCall = "## Call CompiledFxGraph ";
constexpr std::string_view kCollective = "c10d::";

bool starts_with(const char* name, std::string_view prefix) {
  return std::strncmp(name, prefix.data(), prefix.size()) == 0;
}

void on_scope(const at::RecordFunction& fn, bool begin) {
  Session* s = g_active.load(std::memory_order_acquire);
  if (s == nullptr) return;
  ThreadState& ts = thread_state(s);
  const char* name = fn.name();
  if (name == nullptr) name = "";
  // (an op's scope waits for an event in it, unless it is a compiled-graph call or a collective)
  const bool op = fn.scope() == at::RecordScope::FUNCTION;
  const bool graph_call = op && name[0] == '#' && starts_with(name, kGraphCall);
  const bool lazy = op && !graph_call && !(name[0] == 'c' && starts_with(name, kCollective));
  record_scope(s, ts, scope_id(s, ts, name), begin, lazy, graph_call);
}

std::unique_ptr<at::ObserverContext> on_scope_enter(const at::RecordFunction& fn) {
  on_scope(fn, true);
  return nullptr;
}

void on_scope_exit(const at::RecordFunction& fn, at::ObserverContext* /*ctx*/) { on_scope(fn, false); }

// The callback this thread switched off (0: none): a capture that stopped meanwhile took its handle
// with it, and a new one's is not this thread's to switch back on.
thread_local at::CallbackHandle t_quiet_handle = 0;

void append_marker(uint8_t kind, int64_t value, std::string_view label) {
  Session* s = g_active.load(std::memory_order_acquire);
  if (s == nullptr) return;
  ThreadState& ts = thread_state(s);
  Event e = make_event(kind, ts);
  e.bytes = value;
  if (!label.empty()) e.scope = s->strings.intern(label);
  append(s, ts, e);
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
    append(s, ts, e);
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
      append(s, ts, e);
      break;
    }
    default:
      break;
  }
}
#endif

}  // namespace

namespace {
// A forked child (a DataLoader worker) inherits the parent's active session, wrapper and reporter:
// it must record nothing (its events would only grow a copy of the store no one reads).
void stop_in_forked_child() {
  Session* s = g_active.exchange(nullptr);
  if (s != nullptr) s->active.store(false);  // the reporter the child's thread inherited stops too
}
}  // namespace

void start_capture(const CaptureOptions& options) {
  std::lock_guard<std::mutex> lock(g_control_mu);
  static const int fork_handler = pthread_atfork(nullptr, nullptr, &stop_in_forked_child);
  (void)fork_handler;
  if (g_shutdown.load()) throw std::runtime_error("memprof is shut down (interpreter exiting)");
  if (g_active.load() != nullptr) throw std::runtime_error("a memprof capture is already active");
  if (torch::profiler::impl::ProfilerStateBase::get(/*global=*/false) != nullptr ||
      torch::profiler::impl::ProfilerStateBase::get(/*global=*/true) != nullptr) {
    throw std::runtime_error(
        "torch.profiler is active on this thread; memprof and torch.profiler share "
        "PyTorch's profiler slot, so stop the profiler before capturing");
  }
  auto* s = new Session(options);
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
  Session* previous = g_last.exchange(s);
  if (previous != nullptr) previous->store.clear();
  calibrate_clock();
  s->t_start = now_ns();
  s->store.set_chunk_hook(&wake_waiter);  // the capture's thread writes the spill (when it has one)
  s->cpu_wrapper_problem = install_cpu_wrapper();
  s->cpu_wrapped.store(s->cpu_wrapper_problem.empty(), std::memory_order_relaxed);
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
  uninstall_cpu_wrapper();
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

void freeze_capture() {
  std::lock_guard<std::mutex> lock(g_control_mu);
  Session* s = g_active.exchange(nullptr);
  if (s == nullptr) return;
  s->active.store(false);
  s->t_stop = now_ns();
}

bool capture_active() { return g_active.load() != nullptr; }

namespace {
// Whether memprof's op scopes are off on this thread for the active capture (a handle left by one
// that stopped meanwhile, with an exception in between, does not count).
Session* quiet_session() {
  Session* s = g_active.load(std::memory_order_acquire);
  return s != nullptr && t_quiet_handle != 0 && t_quiet_handle == s->handle ? s : nullptr;
}
}  // namespace

bool set_quiet(bool quiet) {
  Session* s = g_active.load(std::memory_order_acquire);
  const bool was = quiet_session() != nullptr;
  if (quiet == was) return was;
  if (!quiet) {
    at::reenableCallback(t_quiet_handle);
    t_quiet_handle = 0;
    return was;
  }
  if (s == nullptr || s->handle == 0) return was;
  // disableCallback finds the handle among this thread's callbacks (each thread holds its own copy),
  // so the other threads' scopes go on, and other observers' callbacks are left as they are
  at::disableCallback(s->handle);
  t_quiet_handle = s->handle;
  return was;
}

bool quiet_scope(std::string_view name, bool begin) {
  Session* s = quiet_session();
  if (s == nullptr) return false;
  ThreadState& ts = thread_state(s);
  record_scope(s, ts, intern_cached(s, ts, name).first, begin);
  return true;
}

namespace {
// Each accessor reads the session once: g_last may be replaced meanwhile only by a new capture.
Session* last() { return g_last.load(std::memory_order_acquire); }
}  // namespace

size_t event_count() {
  Session* s = last();
  return s ? s->store.size() : 0;
}
size_t copy_events(Event* dst, size_t capacity) {
  Session* s = last();
  return s ? s->store.copy_to(dst, capacity) : 0;
}
size_t copy_events_range(size_t start, Event* dst, size_t count) {
  Session* s = last();
  return s ? s->store.copy_range(start, dst, count) : 0;
}
void release_events_before(size_t n) {
  if (Session* s = last()) s->store.release_before(n);
}
int64_t write_spill_records(int fd, size_t start, size_t count) {
  Session* s = last();
  return s ? s->store.write_records(fd, start, count) : 0;
}
size_t released_events() {
  Session* s = last();
  return s ? s->store.released() : 0;
}
EventStore::Head ring_head() {
  Session* s = last();
  return s ? s->store.ring_head() : EventStore::Head{};
}
std::vector<CarriedContext> window_context() {
  Session* s = last();
  return s ? s->store.window_context() : std::vector<CarriedContext>{};
}
std::string window_state() {
  Session* s = last();
  return s ? s->store.window_state() : std::string("all");
}
size_t store_bytes() {
  Session* s = last();
  return s ? s->store.bytes_reserved() : 0;
}
std::vector<std::string> strings_from(size_t first) {
  Session* s = last();
  return s ? s->strings.snapshot_from(first) : std::vector<std::string>{};
}
std::vector<std::string> strings() {
  Session* s = last();
  return s ? s->strings.snapshot() : std::vector<std::string>{""};
}
uint64_t dropped_events() {
  Session* s = last();
  return s ? s->store.dropped() : 0;
}
int64_t first_dropped_ns() {
  Session* s = last();
  return s ? s->store.first_dropped_ns() : -1;
}
std::string cpu_all_threads_problem() {
  Session* s = last();
  return s ? s->cpu_wrapper_problem : std::string();
}
size_t max_events() {
  Session* s = last();
  return s ? s->store.max_events() : 0;
}
void set_max_events(size_t n) {
  if (Session* s = last()) s->store.set_max_events(n);
}
int64_t capture_start_ns() {
  Session* s = last();
  return s ? s->t_start : 0;
}
int64_t capture_stop_ns() {
  Session* s = last();
  return s ? s->t_stop : 0;
}

void release() {
  std::lock_guard<std::mutex> lock(g_control_mu);
  Session* s = last();
  if (s != nullptr && g_active.load() != s) s->store.clear();
}

void mark_step(int64_t step) {
  Session* s = g_active.load(std::memory_order_acquire);
  if (s == nullptr) return;
  Event e = make_event(kStep, thread_state(s));
  e.bytes = step;
  s->store.mark_step(e);
}
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
