// Fatal signals while a capture runs: SIGTERM and SIGHUP, where their disposition is the default
// (they would kill the process), are caught at the OS level only, so Python's signal module still
// answers SIG_DFL and a script that sets its own handler replaces memprof's. The handler only
// writes the signal to a pipe; a watcher thread passes it on to the thread that waits for it (which
// saves the capture), and if that thread has not taken it within kAckTimeoutMs (it could not get
// the GIL: the program is stuck in native code) the process dies by the signal at once, as it would
// have without memprof. No Python here.
#pragma once

#include <cstdint>
#include <vector>

namespace memprof {

// Installs the handler for each of `signals` whose disposition is SIG_DFL now; returns those taken.
// With `hold`, the handler also calls the hook set by set_hold_hook (bindings.cpp: the main thread
// stops at its next bytecode, as a Python-level handler would have it run there).
std::vector<int> take_fatal_signals(const std::vector<int>& signals, bool hold);
// Gives back the signals taken (SIG_DFL again, where memprof's handler is still the one installed)
// and wakes the waiter: wait_fatal_signal returns a signal that came before, else -1.
void give_back_fatal_signals();
// Waits up to timeout_ms for a fatal signal: its number, 0 when none came in time, -1 once the signals
// were given back. The first one returned is acknowledged: from then on the process is ending and
// further fatal signals only print that the capture is being saved.
int wait_fatal_signal(int64_t timeout_ms);
// Wakes wait_fatal_signal early: it returns 0, as at its timeout (the event store asks the capture's
// thread to write the spill once it holds kFlushChunks chunks). Safe from any thread and cheap when
// repeated; a wake-up the waiter misses (it was not waiting yet) only waits for the timeout.
void wake_waiter();
// What the handler calls to hold the main thread (set once, by bindings.cpp), and whether a hold it
// asked for is still wanted when it runs (the signals may have been given back meanwhile).
void set_hold_hook(void (*hook)());
bool hold_wanted();
// Resets `signum` to its default action, unblocks it and sends it to this process (it does not
// return where the default action ends the process).
void die_by_signal(int signum);

}  // namespace memprof
