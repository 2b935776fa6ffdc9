// memprof capture sessions: the allocation reporter, RecordFunction scopes and,
// on CUDA builds, the caching-allocator trace tracker. No Python headers here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>
#include <string>
#include <string_view>
#include <vector>

#include "events.h"

namespace memprof {

enum ScopeBits : unsigned {
  kScopeFunction = 1,  // aten ops and Inductor kernel launches
  kScopeBackward = 2,  // autograd nodes
  kScopeUser = 4,      // compiled-graph calls, torch.profiler.record_function regions
};

struct CaptureOptions {
  size_t max_events = size_t(1) << 24;
  // RecordFunction scopes to record, as ScopeBits. Any FUNCTION-scope callback makes
  // every aten op on the thread build a RecordFunction, the main cost of a capture;
  // USER_SCOPE alone keeps compiled-graph calls and user record_function regions.
  unsigned scope_bits = kScopeFunction | kScopeBackward | kScopeUser;
  // Which events are stored (a step window or a ring of the last steps): StoreOptions.
  int64_t first_step = 1;
  int64_t last_step = std::numeric_limits<int64_t>::max();
  size_t keep_last = 0;
};

// Starts a capture on the calling thread (and the autograd threads it starts).
// Throws std::runtime_error if a capture or torch.profiler is already active.
void start_capture(const CaptureOptions& options);
// Stops the active capture; must run on the thread that started it. Returns a
// warning ("" if none), e.g. when the reporter could not be popped cleanly.
std::string stop_capture();
// Ends the active capture from any thread, for a process about to die by a signal: nothing more is
// recorded (the hooks stay in place, inert), and its results can be read as after stop_capture.
void freeze_capture();
bool capture_active();

// Results of the last capture (valid after stop_capture, until release()).
size_t event_count();
size_t copy_events(Event* dst, size_t capacity);
// While the capture runs too (the spill): events [start, start + count), strings from id `first`.
size_t copy_events_range(size_t start, Event* dst, size_t count);
std::vector<std::string> strings_from(size_t first);
void release_events_before(size_t n);
// Events [start, start + count) appended to the spill's descriptor as its records (EventStore::write_records).
int64_t write_spill_records(int fd, size_t start, size_t count);
size_t released_events();
// With keep_last: the ring's first stored event, the events carried into it (blocks live there) and
// their scope context.
EventStore::Head ring_head();
// With a step window that opened: the scope context of the blocks carried into it.
std::vector<CarriedContext> window_context();
// The step window's state ("all" without one, "pending", "open", "closed").
std::string window_state();
size_t store_bytes();
std::vector<std::string> strings();
uint64_t dropped_events();
// Time of the first event that did not fit in max_events (-1 if none).
int64_t first_dropped_ns();
// "" when the capture saw CPU allocations and frees on every thread (the CPU allocator was
// wrapped), else why it saw only those of the capturing thread and its autograd threads.
std::string cpu_all_threads_problem();
size_t max_events();
// The active capture's bound on stored events from now on (EventStore::set_max_events).
void set_max_events(size_t n);
int64_t capture_start_ns();
int64_t capture_stop_ns();
void release();

// memprof's op scopes on the calling thread only, switched off (`quiet` true) or back on; returns
// whether they were off. While they are off an aten op takes the dispatcher's fast path, as without a
// capture: a compiled-graph call's body runs quiet, the calls in it that allocate loud.
bool set_quiet(bool quiet);
// While memprof's op scopes are off on the calling thread: records the begin (or the end) of a scope
// named `name` as if RecordFunction had opened it (a call that allocates in a quiet compiled-graph
// call, its own ops left quiet), and returns true; else records nothing and returns false.
bool quiet_scope(std::string_view name, bool begin);

// Markers on the calling thread, recorded only while a capture is active.
void mark_step(int64_t step);
void mark(std::string_view label);

// CUDA builds only: attach the allocator trace tracker once per process
// (after CUDA is initialized). Returns "" on success or the reason it failed.
bool cuda_built();
std::string attach_cuda_tracker();
bool cuda_tracker_attached();

// Called at interpreter exit: stops recording from any callback for good.
void shutdown();

}  // namespace memprof
