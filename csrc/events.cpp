#include "events.h"

#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#if defined(__linux__)
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace memprof {

StringTable::StringTable() { intern(""); }

uint32_t StringTable::intern(std::string_view s) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = index_.find(s);
  if (it != index_.end()) return it->second;
  auto id = static_cast<uint32_t>(strings_.size());
  strings_.push_back(std::make_unique<std::string>(s));
  index_.emplace(std::string_view(*strings_.back()), id);
  return id;
}

std::vector<std::string> StringTable::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  out.reserve(strings_.size());
  for (const auto& s : strings_) out.push_back(*s);
  return out;
}

std::vector<std::string> StringTable::snapshot_from(size_t first) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  for (size_t i = first; i < strings_.size(); ++i) out.push_back(*strings_[i]);
  return out;
}

uint32_t LiveSet::Frame::next_occurrence(uint32_t child) {
  if (many) return (*many)[child]++;
  for (auto& [id, count] : children) {
    if (id == child) return count++;
  }
  if (children.size() < 16) {
    children.emplace_back(child, 1);
    return 0;
  }
  many = std::make_unique<std::unordered_map<uint32_t, uint32_t>>(children.begin(), children.end());
  children.clear();
  return (*many)[child]++;
}

void LiveSet::apply(const Event& e) {
  const Key key{e.ptr, static_cast<int16_t>((int16_t(e.device_type) << 8) | uint8_t(e.device_index))};
  switch (e.kind) {
    case kScopeBegin: {
      ThreadScopes& t = scopes_[e.thread];
      const uint32_t occurrence = t.open.empty() ? 0 : t.open.back().next_occurrence(e.scope);
      t.open.push_back(Frame{e.scope, occurrence, 0, {}, nullptr});
      break;
    }
    case kScopeEnd: {  // closes the innermost open scope of its id and what was left open inside it
      auto found = scopes_.find(e.thread);
      if (found == scopes_.end()) break;
      auto& open = found->second.open;
      for (size_t i = open.size(); i > 0; --i) {
        if (open[i - 1].scope == e.scope) {
          open.resize(i - 1);
          break;
        }
      }
      break;
    }
    case kAlloc:
    case kCudaAlloc: {
      ThreadScopes& t = scopes_[e.thread];
      Block b{seq_++, e, {}, 0};
      b.path.reserve(t.open.size());
      for (const Frame& f : t.open) b.path.emplace_back(f.scope, f.occurrence);
      b.ordinal = t.open.empty() ? t.top_level++ : t.open.back().direct++;
      live_[key] = std::move(b);
      break;
    }
    case kFree:
    case kCudaFreeRequested: {
      auto it = live_.find(key);
      if (it != live_.end()) {
        live_.erase(it);
      } else {
        freed_before_.push_back(e);  // a block allocated before the capture
      }
      break;
    }
    case kSegmentAlloc:
    case kSegmentFree:
    case kSegmentMap:
    case kSegmentUnmap: {
      auto [it, fresh] = reserved_.try_emplace(key.device, e);
      if (!fresh) {
        it->second.bytes += e.bytes;
        it->second.t_ns = e.t_ns;
      }
      it->second.kind = kSegmentAlloc;
      break;
    }
    default:
      break;
  }
}

std::vector<const LiveSet::Block*> LiveSet::ordered() const {
  std::vector<const Block*> blocks;
  blocks.reserve(live_.size());
  for (const auto& kv : live_) blocks.push_back(&kv.second);
  std::sort(blocks.begin(), blocks.end(), [](auto* a, auto* b) { return a->seq < b->seq; });
  return blocks;
}

std::vector<Event> LiveSet::carried() const {
  std::vector<Event> out(freed_before_);
  for (const Block* b : ordered()) out.push_back(b->event);
  for (const auto& kv : reserved_) {
    if (kv.second.bytes != 0) out.push_back(kv.second);
  }
  for (auto& e : out) e.flags |= kFlagCarried;
  return out;
}

std::vector<CarriedContext> LiveSet::carried_context() const {
  std::vector<CarriedContext> out;
  auto index = static_cast<uint32_t>(freed_before_.size());  // carried() puts the live blocks after these
  for (const Block* b : ordered()) out.push_back(CarriedContext{index++, b->path, b->ordinal});
  return out;
}

void LiveSet::clear() {
  live_.clear();
  scopes_.clear();
  freed_before_.clear();
  reserved_.clear();
  seq_ = 0;
}

EventStore::EventStore(const StoreOptions& options) : options_(options) {
  if (options.keep_last == 0 && (options.first_step > 1 || options.last_step < std::numeric_limits<int64_t>::max())) {
    window_ = options.first_step > 1 ? Window::kPending : Window::kOpen;
    recording_ = options.first_step <= 1;
  }
}

namespace {
uint64_t block_key(const Event& e) {
  return e.ptr ^ (uint64_t(uint16_t((int16_t(e.device_type) << 8) | uint8_t(e.device_index))) << 48);
}
bool is_alloc(const Event& e) { return e.kind == kAlloc || e.kind == kCudaAlloc; }
bool is_free(const Event& e) { return e.kind == kFree || e.kind == kCudaFreeRequested; }
}  // namespace

void EventStore::append_locked(const Event& e) {
  if (window_ == Window::kPending) live_.apply(e);
  if (window_ == Window::kOpen && (is_alloc(e) || is_free(e))) {
    auto key = block_key(e);
    if (is_alloc(e)) {
      ++window_live_[key];
    } else if (auto it = window_live_.find(key); it != window_live_.end() && --it->second == 0) {
      window_live_.erase(it);
    }
  }
  if (recording_) {
    push(e);
  } else if (window_ == Window::kClosed) {
    if (tail_scopes_ && (e.kind == kScopeBegin || e.kind == kScopeEnd)) {
      push(e);
    } else if (!window_live_.empty() && is_free(e)) {
      auto it = window_live_.find(block_key(e));
      if (it != window_live_.end()) {
        push(e);
        if (--it->second == 0) window_live_.erase(it);
      }
    }
  }
}

void EventStore::push_slow(const Event& e) {
  if (size_ - ring_start_ >= options_.max_events) {
    if (dropped_ == 0) first_dropped_ns_ = e.t_ns;
    ++dropped_;
    return;
  }
  const size_t offset = size_ % kChunkEvents;
  if (offset == 0) {
    if (spare_.empty()) {
      chunks_.emplace_back(new Event[kChunkEvents]);
    } else {
      chunks_.push_back(std::move(spare_.back()));
      spare_.pop_back();
    }
    if (chunk_hook_ != nullptr && chunks_.size() - released_ / kChunkEvents > kFlushChunks) chunk_hook_();
  }
  chunks_.back()[offset] = e;
  ++size_;
}

void EventStore::mark_step(const Event& e) {
  std::lock_guard<SpinLock> lock(mu_);
  const int64_t step = e.bytes;
  if (window_ == Window::kPending && step >= options_.first_step - 1) {
    for (const Event& c : live_.carried()) {
      push(c);
      if (is_alloc(c)) ++window_live_[block_key(c)];
    }
    window_context_ = live_.carried_context();
    live_.clear();
    window_ = Window::kOpen;
    recording_ = true;
    push(e);
  } else if (window_ == Window::kOpen && step >= options_.last_step) {
    push(e);
    window_ = Window::kClosed;
    recording_ = false;
    tail_scopes_ = true;
  } else if (window_ == Window::kClosed) {
    tail_scopes_ = false;
  } else if (recording_) {
    const size_t before = size_;
    push(e);
    if (options_.keep_last > 0 && size_ > before) {
      ring_markers_.push_back(before);
      move_ring();
    }
  }
}

void EventStore::move_ring() {
  const size_t complete = ring_markers_.size() - (ring_moved_ ? 1 : 0);  // (the first is the ring's start)
  if (complete <= options_.keep_last) return;
  const size_t start = ring_markers_[ring_markers_.size() - 1 - options_.keep_last];
  for (size_t i = ring_start_; i < start; ++i) ring_base_.apply(chunks_[i / kChunkEvents][i % kChunkEvents]);
  while (ring_markers_.front() != start) ring_markers_.pop_front();
  ring_start_ = start;
  ring_moved_ = true;
  free_chunks_before(start);
}

void EventStore::free_chunks_before(size_t n) {
  const size_t upto = std::min(n, size_) / kChunkEvents;  // whole chunks only
  for (size_t c = released_ / kChunkEvents; c < upto; ++c) {
    if (chunks_[c] && spare_.size() < kFlushChunks) {
      spare_.push_back(std::move(chunks_[c]));
    } else {
      chunks_[c].reset();
    }
  }
  released_ = std::max(released_, upto * kChunkEvents);
}

EventStore::Head EventStore::ring_head() const {
  std::lock_guard<SpinLock> lock(mu_);
  if (!ring_moved_) return {};
  return {ring_start_, ring_base_.carried(), ring_base_.carried_context()};
}

std::vector<CarriedContext> EventStore::window_context() const {
  std::lock_guard<SpinLock> lock(mu_);
  return window_context_;
}

std::string EventStore::window_state() const {
  std::lock_guard<SpinLock> lock(mu_);
  switch (window_) {
    case Window::kPending:
      return "pending";
    case Window::kOpen:
      return "open";
    case Window::kClosed:
      return "closed";
    default:
      return "all";
  }
}

size_t EventStore::size() const {
  std::lock_guard<SpinLock> lock(mu_);
  return size_;
}

uint64_t EventStore::dropped() const {
  std::lock_guard<SpinLock> lock(mu_);
  return dropped_;
}

int64_t EventStore::first_dropped_ns() const {
  std::lock_guard<SpinLock> lock(mu_);
  return dropped_ ? first_dropped_ns_ : -1;
}

size_t EventStore::bytes_reserved() const {
  std::lock_guard<SpinLock> lock(mu_);
  return (chunks_.size() - released_ / kChunkEvents + spare_.size()) * kChunkEvents * sizeof(Event);
}

void EventStore::release_before(size_t n) {
  std::lock_guard<SpinLock> lock(mu_);
  if (options_.keep_last > 0) return;  // the ring frees its own chunks as it moves
  free_chunks_before(n);
}

size_t EventStore::released() const {
  std::lock_guard<SpinLock> lock(mu_);
  return released_;
}

size_t EventStore::copy_to(Event* dst, size_t capacity) const {
  std::lock_guard<SpinLock> lock(mu_);
  if (released_ > 0) return 0;  // some events live only in the spill now
  const size_t n = std::min(size_, capacity);
  size_t done = 0;
  for (size_t c = 0; done < n; ++c) {
    const size_t take = std::min(kChunkEvents, n - done);
    std::memcpy(dst + done, chunks_[c].get(), take * sizeof(Event));
    done += take;
  }
  return n;
}

size_t EventStore::copy_range(size_t start, Event* dst, size_t count) const {
  std::lock_guard<SpinLock> lock(mu_);
  if (start >= size_ || start < released_) return 0;
  const size_t n = std::min(count, size_ - start);
  size_t done = 0;
  while (done < n) {
    const size_t at = start + done;
    const size_t offset = at % kChunkEvents;
    const size_t take = std::min(kChunkEvents - offset, n - done);
    std::memcpy(dst + done, chunks_[at / kChunkEvents].get() + offset, take * sizeof(Event));
    done += take;
  }
  return n;
}

int64_t EventStore::write_records(int fd, size_t start, size_t count) const {
  std::vector<std::pair<const Event*, size_t>> parts;
  {
    // the chunk pointers only: the writes run without the lock, so allocations never wait on the disk
    // (chunks before size() are only freed by release_before, which the writer itself calls after)
    std::lock_guard<SpinLock> lock(mu_);
    if (options_.keep_last > 0) return -EINVAL;
    if (start < released_) return -EINVAL;
    const size_t n = start < size_ ? std::min(count, size_ - start) : 0;
    for (size_t done = 0; done < n;) {
      const size_t at = start + done;
      const size_t offset = at % kChunkEvents;
      const size_t take = std::min(kChunkEvents - offset, n - done);
      parts.emplace_back(chunks_[at / kChunkEvents].get() + offset, take);
      done += take;
    }
  }
  int64_t written = 0;
  for (const auto& [events, n] : parts) {
    const uint64_t length = n * sizeof(Event);
    unsigned char head[9];
    head[0] = 'E';
    for (int i = 0; i < 8; ++i) head[1 + i] = static_cast<unsigned char>(length >> (8 * i));
    iovec iov[2] = {{head, sizeof(head)}, {const_cast<Event*>(events), length}};
    int at = 0;
    while (at < 2) {
      const ssize_t w = ::writev(fd, iov + at, 2 - at);
      if (w < 0) {
        if (errno == EINTR) continue;
        return -errno;
      }
      size_t left = static_cast<size_t>(w);
      while (at < 2 && left >= iov[at].iov_len) left -= iov[at++].iov_len;
      if (at < 2) {
        iov[at].iov_base = static_cast<char*>(iov[at].iov_base) + left;
        iov[at].iov_len -= left;
      }
    }
    written += static_cast<int64_t>(n);
  }
  return written;
}

size_t EventStore::max_events() const {
  std::lock_guard<SpinLock> lock(mu_);
  return options_.max_events;
}

void EventStore::set_max_events(size_t n) {
  std::lock_guard<SpinLock> lock(mu_);
  options_.max_events = n;
}

void EventStore::set_chunk_hook(void (*hook)()) {
  std::lock_guard<SpinLock> lock(mu_);
  chunk_hook_ = hook;
}

void EventStore::clear() {
  std::lock_guard<SpinLock> lock(mu_);
  chunks_.clear();
  chunks_.shrink_to_fit();
  spare_.clear();
  size_ = 0;
  released_ = 0;
  ring_markers_.clear();
  ring_start_ = 0;
  ring_moved_ = false;
  live_.clear();
  ring_base_.clear();
  window_context_.clear();
  window_live_.clear();
  tail_scopes_ = false;
}

namespace clock_detail {
std::atomic<const TscMap*> g_tsc_map{nullptr};

int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace clock_detail

#ifdef MEMPROF_TSC_CLOCK
namespace {
struct Anchor {
  uint64_t tsc = 0;
  int64_t ns = 0;
};

// A TSC reading and the steady-clock time it was taken at: the middle of two steady-clock reads
// around it, taken where they lie close together (not split by an interrupt or a preemption).
bool take_anchor(Anchor& out) {
  for (int i = 0; i < 64; ++i) {
    const int64_t before = clock_detail::steady_ns();
    const uint64_t tsc = __rdtsc();
    const int64_t after = clock_detail::steady_ns();
    if (after - before <= 200) {
      out = Anchor{tsc, before + (after - before) / 2};
      return true;
    }
  }
  return false;
}

bool tsc_is_the_clocksource() {
  std::FILE* f = std::fopen("/sys/devices/system/clocksource/clocksource0/current_clocksource", "r");
  if (f == nullptr) return false;
  char name[32] = {0};
  const bool tsc = std::fgets(name, sizeof(name), f) != nullptr && std::strncmp(name, "tsc\n", 5) == 0;
  std::fclose(f);
  return tsc;
}

// Taken when the module loads: the rate is measured from here to a capture's start.
Anchor g_loaded;
const bool g_tsc_usable = tsc_is_the_clocksource() && take_anchor(g_loaded);
}  // namespace

bool calibrate_clock() {
  if (!g_tsc_usable) return false;
  // The rate's error is the anchors' (tens of ns) over the time between them: at least 50 ms apart,
  // it is within 1 ppm (a capture's first 50 ms of memprof's own start wait for it once).
  constexpr int64_t kMinSpan = 50'000'000;
  const int64_t waited = clock_detail::steady_ns() - g_loaded.ns;
  if (waited < kMinSpan) std::this_thread::sleep_for(std::chrono::nanoseconds(kMinSpan - waited));
  Anchor now;
  if (!take_anchor(now) || now.tsc <= g_loaded.tsc) return false;
  const double ns_per_tick = double(now.ns - g_loaded.ns) / double(now.tsc - g_loaded.tsc);
  if (!(ns_per_tick > 0.01 && ns_per_tick < 100.0)) return false;  // (a TSC from 10 MHz to 100 GHz)
  // leaked: a thread recording an event may still read the map it replaces
  clock_detail::g_tsc_map.store(new clock_detail::TscMap{now.tsc, now.ns, uint64_t(ns_per_tick * 4294967296.0)},
                                std::memory_order_release);
  return true;
}
#else
bool calibrate_clock() { return false; }
#endif

namespace {
std::mutex& threads_mu() {
  static auto* mu = new std::mutex();  // leaked: used until process exit
  return *mu;
}
std::vector<ThreadInfo>& threads() {
  static auto* t = new std::vector<ThreadInfo>();
  return *t;
}

ThreadInfo describe_this_thread(uint32_t index) {
  ThreadInfo info{index, 0, ""};
#if defined(__linux__)
  info.os_tid = static_cast<uint64_t>(::syscall(SYS_gettid));
  char name[32] = {0};
  if (pthread_getname_np(pthread_self(), name, sizeof(name)) == 0) info.name = name;
#endif
  return info;
}
}  // namespace

uint32_t current_thread_index() {
  thread_local uint32_t index = [] {
    std::lock_guard<std::mutex> lock(threads_mu());
    auto idx = static_cast<uint32_t>(threads().size());
    threads().push_back(describe_this_thread(idx));
    return idx;
  }();
  return index;
}

std::vector<ThreadInfo> thread_table() {
  std::lock_guard<std::mutex> lock(threads_mu());
  return threads();
}

}  // namespace memprof
