// memprof native capture core: the event record, the bounded event store and
// the string table. Pure C++17; no torch or Python headers here.
#pragma once

#include <atomic>
#include <cstddef>
#include <deque>
#include <limits>
#include <map>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <x86intrin.h>
#define MEMPROF_TSC_CLOCK 1
#endif

namespace memprof {

// One fixed-size record per allocator event, scope boundary or marker.
// The layout is mirrored by memprof/_events.py (EVENT_DTYPE); event_layout()
// in bindings.cpp exports the offsets so Python checks them at import.
struct Event {
  int64_t t_ns;      // steady-clock nanoseconds
  int64_t bytes;     // + allocation, - free; step number for STEP
  uint64_t ptr;      // address (allocator events), 0 otherwise
  uint64_t stream;   // CUDA stream (from the allocator tracker), 0 otherwise
  int64_t aux;       // CUDA ALLOC: requested bytes (-1 unknown); OOM: free bytes
  uint32_t scope;    // interned name: innermost op/kernel, or the scope itself
  uint16_t thread;   // small per-process thread index (see thread_table())
  uint8_t kind;      // EventKind
  int8_t device_type;   // c10::DeviceType value (0 = CPU, 1 = CUDA), -1 none
  int8_t device_index;  // device ordinal, -1 none
  uint8_t flags;     // EventFlag bits
  uint16_t pad;
};
static_assert(sizeof(Event) == 56, "Event layout is part of the file format");

enum EventFlag : uint8_t {
  kFlagUnfollowedThread = 1,  // seen by the CUDA tracker on a thread without the reporter
  // CPU allocation or free seen by the CPU allocator wrapper on a thread the reporter does not
  // follow (not the capturing thread nor its autograd threads: an intra-op worker, a Python thread)
  kFlagOtherThread = 2,
  // Carried into a step window or the ring of the last steps from before it: a block still live
  // there (its own allocation event, as recorded), a free of a block from before the capture, or
  // a device's reserved bytes so far (one SEGMENT_ALLOC per device).
  kFlagCarried = 4,
};

enum EventKind : uint8_t {
  kAlloc = 0,          // reporter: block allocated (exact block bytes)
  kFree = 1,           // reporter: block freed (negative bytes)
  kScopeBegin = 2,     // RecordFunction start (op, kernel, compiled graph)
  kScopeEnd = 3,       // RecordFunction end
  kStep = 4,           // step marker; bytes = step number
  kCudaAlloc = 5,      // tracker ALLOC on an unfollowed thread; bytes = requested
  kCudaFreeRequested = 6,  // tracker FREE_REQUESTED on an unfollowed thread
  kCudaFreeCompleted = 7,  // reserved for deferred frees (record_stream)
  kSegmentAlloc = 8,   // tracker: reserved memory grows
  kSegmentFree = 9,    // tracker: reserved memory shrinks (negative bytes)
  kSegmentMap = 10,    // expandable segments
  kSegmentUnmap = 11,
  kOom = 12,           // out of memory; bytes = requested size, aux = free bytes or -1
  kMark = 13,          // user marker; scope = label
};

// Interns strings; ids are dense and stable for a session. Id 0 is "".
class StringTable {
 public:
  StringTable();
  uint32_t intern(std::string_view s);
  std::vector<std::string> snapshot() const;
  // Strings from id `first` on (the spill writes them as they appear).
  std::vector<std::string> snapshot_from(size_t first) const;

 private:
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<std::string>> strings_;
  std::unordered_map<std::string_view, uint32_t> index_;
};

// Where in its thread's scope tree a carried block was allocated: the scopes open around the
// allocation, outermost first, each as (scope id, its occurrence among its parent's children of that
// id: the k-th `aten::mm` of a compiled-graph call), and the allocation's ordinal among those made
// directly in the innermost of them (or at the top level). The analysis joins a carried block to
// its compiled graph's buffers with it, as it joins the blocks of a call it holds whole.
struct CarriedContext {
  uint32_t index = 0;  // the carried event it belongs to (an index into carried())
  std::vector<std::pair<uint32_t, uint32_t>> path;
  uint32_t ordinal = 0;
};

// What is live at one point of a run, kept from allocator and scope events: every live block's
// allocation event and where in the scope tree it was made, the frees of blocks allocated before
// the capture, and each device's reserved bytes. It lets a step window or the ring of the last
// steps begin with exactly what was live there, labelled as a full capture labels it.
class LiveSet {
 public:
  void apply(const Event& e);
  // Events that recreate this state, flagged kFlagCarried: frees of blocks from before the
  // capture, live blocks' allocations (in the order they happened), reserved bytes per device.
  std::vector<Event> carried() const;
  // The scope context of each carried allocation, as carried() orders them.
  std::vector<CarriedContext> carried_context() const;
  void clear();

 private:
  struct Key {
    uint64_t ptr;
    int16_t device;
    bool operator==(const Key& o) const { return ptr == o.ptr && device == o.device; }
  };
  struct KeyHash {
    size_t operator()(const Key& k) const { return std::hash<uint64_t>()(k.ptr ^ (uint64_t(uint16_t(k.device)) << 48)); }
  };
  // One open scope on a thread: its id and occurrence, the allocations made directly in it and how
  // many children of each id it has opened (a few ids each; a compiled-graph call has hundreds).
  struct Frame {
    uint32_t scope;
    uint32_t occurrence;
    uint32_t direct = 0;
    std::vector<std::pair<uint32_t, uint32_t>> children;
    std::unique_ptr<std::unordered_map<uint32_t, uint32_t>> many;
    uint32_t next_occurrence(uint32_t child);
  };
  struct ThreadScopes {
    std::vector<Frame> open;
    uint32_t top_level = 0;  // allocations made with no scope open
  };
  struct Block {
    uint64_t seq;
    Event event;
    std::vector<std::pair<uint32_t, uint32_t>> path;
    uint32_t ordinal;
  };
  std::vector<const Block*> ordered() const;
  uint64_t seq_ = 0;
  std::unordered_map<Key, Block, KeyHash> live_;
  std::unordered_map<uint16_t, ThreadScopes> scopes_;
  std::vector<Event> freed_before_;
  std::map<int16_t, Event> reserved_;
};

// The store's lock (and the CPU allocator wrapper's), taken for every event: uncontended, a lock and
// an unlock are one atomic exchange and one plain store, inline (std::mutex: a call and an atomic
// read-modify-write each way, 4% of a loop of small allocations). It is held for a few stores, a
// chunk's allocation or a copy out of the chunks: a waiter spins a little, then yields the core.
class SpinLock {
 public:
  void lock() noexcept {
    while (flag_.exchange(true, std::memory_order_acquire)) {
      for (int spins = 0; flag_.load(std::memory_order_relaxed); ++spins) {
        if (spins < 64) {
          pause();
        } else {
          std::this_thread::yield();
        }
      }
    }
  }
  bool try_lock() noexcept {
    return !flag_.load(std::memory_order_relaxed) && !flag_.exchange(true, std::memory_order_acquire);
  }
  void unlock() noexcept { flag_.store(false, std::memory_order_release); }

 private:
  static void pause() noexcept {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_ia32_pause();
#endif
  }
  std::atomic<bool> flag_{false};
};

// Which events a capture stores. By default all of them. With a step window [first_step,
// last_step], only those from the marker that ends step first_step - 1 to the one that ends
// last_step (step 1 starts at the capture start), after the blocks live at the window start, and
// then the frees of the window's blocks still live at its end (and the next step's scopes).
// With keep_last N, a ring of the last N complete steps and the one in progress, after the
// blocks live at the ring's start.
struct StoreOptions {
  size_t max_events = size_t(1) << 24;
  int64_t first_step = 1;
  int64_t last_step = std::numeric_limits<int64_t>::max();
  size_t keep_last = 0;
};

// Chunked, bounded, append-only store. Appends never move existing events;
// when max_events is reached, further events are counted as dropped.
class EventStore {
 public:
  static constexpr size_t kChunkEvents = size_t(1) << 15;  // 1.75 MiB chunks
  // Chunks held in memory past which each new one calls the chunk hook (the spill is written then,
  // not only every half second: a capture streaming millions of events a second stays near this)
  static constexpr size_t kFlushChunks = 8;

  explicit EventStore(size_t max_events) : EventStore(StoreOptions{max_events}) {}
  explicit EventStore(const StoreOptions& options);
  void append(const Event& e) {
    std::lock_guard<SpinLock> lock(mu_);
    if (window_ == Window::kAll) return push(e);  // (every event is stored: push's inline path)
    append_locked(e);
  }
  // A step marker (e.bytes = the step number): opens or closes the window, moves the ring.
  void mark_step(const Event& e);
  // The ring's first stored event (0 without a ring), the events carried into it and their context,
  // read together.
  struct Head {
    size_t start = 0;
    std::vector<Event> carried;
    std::vector<CarriedContext> context;
  };
  Head ring_head() const;
  // The context of the blocks carried into an open step window (empty before it opens).
  std::vector<CarriedContext> window_context() const;
  // "pending" (the window has not opened), "open", "closed" or "all" (no window).
  std::string window_state() const;
  size_t size() const;
  uint64_t dropped() const;
  // Time of the first event that did not fit (-1 if none): everything after it is incomplete.
  int64_t first_dropped_ns() const;
  size_t max_events() const;
  // Lowers (or raises) the bound while the capture runs: a spill that stopped being writable makes the
  // store keep events in memory again, so it bounds them from there.
  void set_max_events(size_t n);
  // Called (with the store's lock held: it must not touch the store) when a new chunk makes more than
  // kFlushChunks held in memory.
  void set_chunk_hook(void (*hook)());
  size_t bytes_reserved() const;
  // Copies all events into dst (capacity size() events); returns the count.
  size_t copy_to(Event* dst, size_t capacity) const;
  // Copies events [start, start + count) (clipped to size()) into dst; returns the count. Safe while
  // events are appended (the spill copies what the capture recorded so far).
  size_t copy_range(size_t start, Event* dst, size_t count) const;
  // Appends events [start, start + count) (clipped to size()) to the file `fd` as spill records
  // (memprof/spill.py): each the byte 'E', its payload's length (8 bytes, little-endian) and the raw
  // events of at most one chunk, written from the chunks themselves: no copy, no fresh memory. Returns
  // the events written, or -errno where a write failed (the records before it are whole). Not with a
  // ring, whose chunks are freed as it moves (-EINVAL: copy_range instead).
  int64_t write_records(int fd, size_t start, size_t count) const;
  // Frees the chunks whose events all lie before `n` (the spill has them on disk): the memory a
  // streaming capture holds stays about one chunk. Those events can no longer be copied out.
  void release_before(size_t n);
  size_t released() const;
  // Frees all chunks (after the events were copied out).
  void clear();

 private:
  void append_locked(const Event& e);  // with mu_ held
  // With mu_ held. Inline for its common case (every event of a capture takes it): room in the current
  // chunk under the bound; push_slow starts a chunk or counts the event dropped.
  void push(const Event& e) {
    const size_t offset = size_ % kChunkEvents;
    if (offset == 0 || size_ - ring_start_ >= options_.max_events) return push_slow(e);
    chunks_.back()[offset] = e;
    ++size_;
  }
  void push_slow(const Event& e);
  void move_ring();           // with mu_ held
  void free_chunks_before(size_t n);  // with mu_ held: the chunks whose events all lie before n
  mutable SpinLock mu_;
  StoreOptions options_;
  bool recording_ = true;
  enum class Window { kAll, kPending, kOpen, kClosed } window_ = Window::kAll;
  LiveSet live_;              // the whole run's live set while the window is pending
  // Blocks allocated in the open window and not yet freed: once it closes, their frees are still
  // stored (after its last marker, in no step), so that what they are (a saved activation is freed
  // in a backward after the window) is told as a full capture tells it.
  std::unordered_map<uint64_t, uint32_t> window_live_;  // (device, ptr) -> allocations at that address
  // From the window's close to the next step marker its scopes are stored too: a block freed then is
  // told freed in a backward or not as in a full capture (the CPU's backward runs on the main thread).
  bool tail_scopes_ = false;
  std::vector<CarriedContext> window_context_;  // of the blocks carried in when the window opened
  LiveSet ring_base_;         // the live set at the ring's start
  std::deque<size_t> ring_markers_;  // stored step markers from the ring's start on
  size_t ring_start_ = 0;
  bool ring_moved_ = false;
  std::vector<std::unique_ptr<Event[]>> chunks_;
  // Chunks freed behind the spill, kept for the next ones (at most kFlushChunks): a streaming capture
  // writes into memory it has touched before, instead of faulting in and zeroing fresh pages (glibc
  // gives freed chunks back to the system, and a capture of millions of events a second paid for it).
  std::vector<std::unique_ptr<Event[]>> spare_;
  void (*chunk_hook_)() = nullptr;
  size_t size_ = 0;
  size_t released_ = 0;  // events in freed chunks (a multiple of kChunkEvents)
  uint64_t dropped_ = 0;
  int64_t first_dropped_ns_ = -1;
};

// The capture's clock: steady-clock nanoseconds (CLOCK_MONOTONIC). Where the kernel keeps that clock
// on the TSC (x86-64 with clocksource "tsc": invariant and the same on every core), each capture reads
// the TSC itself and maps it to the steady clock by a rate measured when it starts (calibrate_clock):
// the steady clock costs 24 ns a read there and the TSC 10, and a capture reads it for every event.
// Elsewhere it reads the steady clock.
namespace clock_detail {
struct TscMap {
  uint64_t tsc0;  // a TSC reading and the steady-clock time it was taken at
  int64_t ns0;
  uint64_t rate;  // nanoseconds per tick, in 32.32 fixed point
};
extern std::atomic<const TscMap*> g_tsc_map;
int64_t steady_ns();
}  // namespace clock_detail

inline int64_t now_ns() {
#ifdef MEMPROF_TSC_CLOCK
  if (const clock_detail::TscMap* m = clock_detail::g_tsc_map.load(std::memory_order_acquire)) {
    const auto ticks = static_cast<int64_t>(__rdtsc() - m->tsc0);  // (< 0: read on another core just before)
    __extension__ using wide = __int128;
    return m->ns0 + static_cast<int64_t>((static_cast<wide>(ticks) * static_cast<wide>(m->rate)) >> 32);
  }
#endif
  return clock_detail::steady_ns();
}

// Maps the TSC to the steady clock anew (at a capture's start); returns whether now_ns reads the TSC.
bool calibrate_clock();

// Per-process thread registry: small indices for threads that produced events.
struct ThreadInfo {
  uint32_t index;
  uint64_t os_tid;
  std::string name;
};
uint32_t current_thread_index();
std::vector<ThreadInfo> thread_table();

}  // namespace memprof
