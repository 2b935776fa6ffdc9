#include "signals.h"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>
#include <fcntl.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace memprof {
namespace {

constexpr int kAckTimeoutMs = 5000;
constexpr int kMaxSignal = 65;

int g_pipe[2] = {-1, -1};
std::array<std::atomic<bool>, kMaxSignal> g_taken{};
// Leaked, and made anew in a forked child: a child must neither destroy a condition variable the
// parent's threads waited on (glibc waits for them at exit) nor find the mutex held by one of them.
std::mutex* g_mu = new std::mutex();
std::condition_variable* g_cv = new std::condition_variable();
int g_pending = 0;     // a fatal signal waiting to be taken by wait_fatal_signal
bool g_ending = false;  // one was taken: the process is ending (the capture is being saved)
bool g_given_back = false;
std::atomic<bool> g_wake{false};  // wake_waiter() was called since the waiter last returned
bool g_watching = false;
std::atomic<bool> g_hold{false};
std::atomic<void (*)()> g_hold_hook{nullptr};

void on_signal(int signum) {  // one write to a non-blocking pipe, and the hold hook
  const int saved = errno;
  const auto byte = static_cast<unsigned char>(signum);
  ssize_t written = ::write(g_pipe[1], &byte, 1);
  (void)written;
  if (g_hold.load()) {
    if (auto hook = g_hold_hook.load()) hook();
  }
  errno = saved;
}

void say(const char* text) {
  size_t n = 0;
  while (text[n] != '\0') ++n;
  ssize_t written = ::write(2, text, n);
  (void)written;
}

void watch(int fd) {
  for (;;) {
    unsigned char byte = 0;
    const ssize_t r = ::read(fd, &byte, 1);
    if (r != 1) {
      if (r < 0 && errno == EINTR) continue;
      return;
    }
    const int signum = byte;
    std::unique_lock<std::mutex> lock(*g_mu);
    if (g_ending) {
      say("memprof: saving the capture, please wait\n");
      continue;
    }
    if (g_pending != 0) continue;
    g_pending = signum;
    g_cv->notify_all();
    // the waiter needs the GIL to take it; a program stuck in native code holding the GIL never
    // lets it: then the signal acts as it would have without memprof (the spill keeps the run)
    if (!g_cv->wait_for(lock, std::chrono::milliseconds(kAckTimeoutMs), [] { return g_ending; })) {
      lock.unlock();
      say("memprof: the capture could not be saved in time (the program did not let go of Python's lock); "
          "its spill holds what was recorded\n");
      die_by_signal(signum);
    }
  }
}

void set_default(int signum) {
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(signum, &dfl, nullptr);
}

// Each signal taken goes back to its default action, where memprof's handler is still the one set (a
// script that set its own since keeps it).
void release_taken() {
  for (int s = 1; s < kMaxSignal; ++s) {
    if (!g_taken[s].exchange(false)) continue;
    struct sigaction current {};
    if (sigaction(s, nullptr, &current) == 0 && current.sa_handler == &on_signal) set_default(s);
  }
}

void in_forked_child() {
  // the watcher thread is not in the child, and the pipe is the parent's: a signal to the child acts
  // as its default again
  release_taken();
  if (g_pipe[0] >= 0) ::close(g_pipe[0]);
  if (g_pipe[1] >= 0) ::close(g_pipe[1]);
  g_pipe[0] = g_pipe[1] = -1;
  g_mu = new std::mutex();
  g_cv = new std::condition_variable();
  g_watching = false;
  g_pending = 0;
  g_ending = false;
  g_hold = false;
}

bool start_watching() {
  if (g_watching) return true;
  static const int fork_handler = pthread_atfork(nullptr, nullptr, &in_forked_child);
  (void)fork_handler;
  if (::pipe(g_pipe) != 0) return false;
  for (int fd : g_pipe) ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  ::fcntl(g_pipe[1], F_SETFL, O_NONBLOCK);
  std::thread(watch, g_pipe[0]).detach();
  g_watching = true;
  return true;
}

}  // namespace

std::vector<int> take_fatal_signals(const std::vector<int>& signals, bool hold) {
  std::lock_guard<std::mutex> lock(*g_mu);
  std::vector<int> taken;
  if (!start_watching()) return taken;
  g_pending = 0;
  g_ending = false;
  g_given_back = false;
  g_hold = hold;
  for (int s : signals) {
    if (s <= 0 || s >= kMaxSignal) continue;
    struct sigaction current {};
    if (sigaction(s, nullptr, &current) != 0) continue;
    if ((current.sa_flags & SA_SIGINFO) != 0 || current.sa_handler != SIG_DFL) continue;  // not ours to take
    struct sigaction mine {};
    mine.sa_handler = &on_signal;
    sigemptyset(&mine.sa_mask);
    mine.sa_flags = SA_RESTART;  // the script's system calls go on as if nothing came
    if (sigaction(s, &mine, nullptr) == 0) {
      g_taken[s] = true;
      taken.push_back(s);
    }
  }
  return taken;
}

void give_back_fatal_signals() {
  std::lock_guard<std::mutex> lock(*g_mu);
  g_hold = false;
  g_given_back = true;
  g_cv->notify_all();
  release_taken();
}

int wait_fatal_signal(int64_t timeout_ms) {
  std::unique_lock<std::mutex> lock(*g_mu);
  const bool woken = g_cv->wait_for(lock, std::chrono::milliseconds(timeout_ms), [] {
    return (g_pending != 0 && !g_ending) || g_given_back || g_wake.load();
  });
  g_wake.store(false);
  if (!woken) return 0;
  if (g_pending != 0 && !g_ending) {
    g_ending = true;
    g_cv->notify_all();
    return g_pending;
  }
  return g_given_back ? -1 : 0;  // (else woken by wake_waiter: as at the timeout)
}

void wake_waiter() {
  if (!g_wake.exchange(true)) g_cv->notify_all();
}

void set_hold_hook(void (*hook)()) { g_hold_hook = hook; }
bool hold_wanted() { return g_hold.load(); }

void die_by_signal(int signum) {
  set_default(signum);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, signum);
  pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
  ::kill(::getpid(), signum);
  for (;;) ::pause();  // the signal ends the process (on whichever thread it is delivered)
}

}  // namespace memprof
