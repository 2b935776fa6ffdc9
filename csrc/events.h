// memprof native capture core: the event record, the bounded event store and
// the string table. Pure C++17; no torch or Python headers here.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

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

// Chunked, bounded, append-only store. Appends never move existing events;
// when max_events is reached, further events are counted as dropped.
class EventStore {
 public:
  static constexpr size_t kChunkEvents = size_t(1) << 15;  // 1.5 MiB chunks

  explicit EventStore(size_t max_events);
  void append(const Event& e);
  size_t size() const;
  uint64_t dropped() const;
  // Time of the first event that did not fit (-1 if none): everything after it is incomplete.
  int64_t first_dropped_ns() const;
  size_t max_events() const { return max_events_; }
  size_t bytes_reserved() const;
  // Copies all events into dst (capacity size() events); returns the count.
  size_t copy_to(Event* dst, size_t capacity) const;
  // Copies events [start, start + count) (clipped to size()) into dst; returns the count. Safe while
  // events are appended (the spill copies what the capture recorded so far).
  size_t copy_range(size_t start, Event* dst, size_t count) const;
  // Frees the chunks whose events all lie before `n` (the spill has them on disk): the memory a
  // streaming capture holds stays about one chunk. Those events can no longer be copied out.
  void release_before(size_t n);
  size_t released() const;
  // Frees all chunks (after the events were copied out).
  void clear();

 private:
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Event[]>> chunks_;
  size_t size_ = 0;
  size_t released_ = 0;  // events in freed chunks (a multiple of kChunkEvents)
  size_t max_events_;
  uint64_t dropped_ = 0;
  int64_t first_dropped_ns_ = -1;
};

int64_t now_ns();

// Per-process thread registry: small indices for threads that produced events.
struct ThreadInfo {
  uint32_t index;
  uint64_t os_tid;
  std::string name;
};
uint32_t current_thread_index();
std::vector<ThreadInfo> thread_table();

}  // namespace memprof
