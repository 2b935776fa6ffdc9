#include "events.h"

#include <algorithm>
#include <chrono>
#include <cstring>

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

EventStore::EventStore(size_t max_events) : max_events_(max_events) {}

void EventStore::append(const Event& e) {
  std::lock_guard<std::mutex> lock(mu_);
  if (size_ >= max_events_) {
    if (dropped_ == 0) first_dropped_ns_ = e.t_ns;
    ++dropped_;
    return;
  }
  const size_t offset = size_ % kChunkEvents;
  if (offset == 0) chunks_.emplace_back(new Event[kChunkEvents]);
  chunks_.back()[offset] = e;
  ++size_;
}

size_t EventStore::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return size_;
}

uint64_t EventStore::dropped() const {
  std::lock_guard<std::mutex> lock(mu_);
  return dropped_;
}

int64_t EventStore::first_dropped_ns() const {
  std::lock_guard<std::mutex> lock(mu_);
  return dropped_ ? first_dropped_ns_ : -1;
}

size_t EventStore::bytes_reserved() const {
  std::lock_guard<std::mutex> lock(mu_);
  return (chunks_.size() - released_ / kChunkEvents) * kChunkEvents * sizeof(Event);
}

void EventStore::release_before(size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t upto = std::min(n, size_) / kChunkEvents;  // whole chunks only
  for (size_t c = released_ / kChunkEvents; c < upto; ++c) chunks_[c].reset();
  released_ = std::max(released_, upto * kChunkEvents);
}

size_t EventStore::released() const {
  std::lock_guard<std::mutex> lock(mu_);
  return released_;
}

size_t EventStore::copy_to(Event* dst, size_t capacity) const {
  std::lock_guard<std::mutex> lock(mu_);
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
  std::lock_guard<std::mutex> lock(mu_);
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

void EventStore::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  chunks_.clear();
  chunks_.shrink_to_fit();
  size_ = 0;
  released_ = 0;
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

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
