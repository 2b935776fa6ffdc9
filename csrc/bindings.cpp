// The one seam between memprof's native core and Python.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <stdexcept>
#include <utility>
#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include <unistd.h>

#include <torch/csrc/autograd/python_variable.h>

#include "capture.h"
#include "events.h"
#include "grads.h"
#include "maxflow.h"
#include "signals.h"

namespace py = pybind11;

namespace {

py::array copy_events_to_numpy() {
  const size_t n = memprof::event_count();
  py::array_t<uint8_t> out(static_cast<py::ssize_t>(n * sizeof(memprof::Event)));
  auto* dst = reinterpret_cast<memprof::Event*>(out.mutable_data());
  size_t copied = 0;
  {
    py::gil_scoped_release release;
    copied = memprof::copy_events(dst, n);
  }
  if (copied != n) {
    throw std::runtime_error(memprof::released_events() > 0
                                 ? "events were released to the spill; read them from there"
                                 : "event store changed during copy-out");
  }
  return out;
}

py::array copy_events_range_to_numpy(size_t start, size_t count) {
  // events are only appended: what exists now can be copied straight into the array
  const size_t size = memprof::event_count();
  const size_t n = start < size ? std::min(count, size - start) : 0;
  py::array_t<uint8_t> out(static_cast<py::ssize_t>(n * sizeof(memprof::Event)));
  size_t copied = 0;
  {
    py::gil_scoped_release release;
    copied = memprof::copy_events_range(start, reinterpret_cast<memprof::Event*>(out.mutable_data()), n);
  }
  if (copied != n) out.resize({static_cast<py::ssize_t>(copied * sizeof(memprof::Event))});
  return out;
}

py::list to_python(const std::vector<std::string>& strings) {
  py::list out;
  for (const auto& s : strings) {
    PyObject* obj = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "replace");
    if (obj == nullptr) throw py::error_already_set();
    out.append(py::reinterpret_steal<py::str>(obj));
  }
  return out;
}

py::dict event_layout() {
  using memprof::Event;
  py::dict d;
  auto field = [&](const char* name, size_t offset, size_t size) {
    d[name] = py::make_tuple(offset, size);
  };
  field("t_ns", offsetof(Event, t_ns), sizeof(Event::t_ns));
  field("bytes", offsetof(Event, bytes), sizeof(Event::bytes));
  field("ptr", offsetof(Event, ptr), sizeof(Event::ptr));
  field("stream", offsetof(Event, stream), sizeof(Event::stream));
  field("aux", offsetof(Event, aux), sizeof(Event::aux));
  field("scope", offsetof(Event, scope), sizeof(Event::scope));
  field("thread", offsetof(Event, thread), sizeof(Event::thread));
  field("kind", offsetof(Event, kind), sizeof(Event::kind));
  field("device_type", offsetof(Event, device_type), sizeof(Event::device_type));
  field("device_index", offsetof(Event, device_index), sizeof(Event::device_index));
  field("flags", offsetof(Event, flags), sizeof(Event::flags));
  d["itemsize"] = sizeof(Event);
  py::dict flags;
  flags["unfollowed_thread"] = static_cast<int>(memprof::kFlagUnfollowedThread);
  flags["other_thread"] = static_cast<int>(memprof::kFlagOtherThread);
  flags["carried"] = static_cast<int>(memprof::kFlagCarried);
  d["flags_values"] = flags;
  return d;
}

// Event kinds and RecordFunction scope sets as the core defines them (Python keeps copies:
// memprof._events.Kind and memprof.recorder.SCOPE_BITS; a test checks they agree).
py::dict constants() {
  using namespace memprof;
  py::dict kinds;
  const std::pair<const char*, EventKind> all[] = {
      {"ALLOC", kAlloc}, {"FREE", kFree}, {"SCOPE_BEGIN", kScopeBegin}, {"SCOPE_END", kScopeEnd},
      {"STEP", kStep}, {"CUDA_ALLOC", kCudaAlloc}, {"CUDA_FREE_REQUESTED", kCudaFreeRequested},
      {"CUDA_FREE_COMPLETED", kCudaFreeCompleted}, {"SEGMENT_ALLOC", kSegmentAlloc},
      {"SEGMENT_FREE", kSegmentFree}, {"SEGMENT_MAP", kSegmentMap}, {"SEGMENT_UNMAP", kSegmentUnmap},
      {"OOM", kOom}, {"MARK", kMark}};
  for (const auto& [name, kind] : all) kinds[name] = static_cast<int>(kind);
  py::dict scopes;
  scopes["function"] = static_cast<unsigned>(kScopeFunction);
  scopes["backward"] = static_cast<unsigned>(kScopeBackward);
  scopes["user"] = static_cast<unsigned>(kScopeUser);
  py::dict d;
  d["kinds"] = kinds;
  d["scope_bits"] = scopes;
  return d;
}

py::list context_to_python(const std::vector<memprof::CarriedContext>& context) {
  py::list out;
  for (const auto& c : context) {
    py::list path;
    for (const auto& [scope, occurrence] : c.path) path.append(py::make_tuple(scope, occurrence));
    out.append(py::make_tuple(c.index, path, c.ordinal));
  }
  return out;
}

// A pending call the main thread runs at its next bytecode: it waits there, without the GIL, for
// the process to die by the fatal signal memprof is saving the capture for (the script stops where
// it was, as the signal would have stopped it). Asked for by the signal handler itself (so the
// script runs no further than a Python-level handler would let it: the signal module's handler
// takes the same path) and again by the capture's thread; a hold that runs after the signals were
// given back (the capture ended normally meanwhile) does nothing.
int hold_forever(void* /*unused*/) {
  if (!memprof::hold_wanted()) return 0;
  Py_BEGIN_ALLOW_THREADS
  for (;;) pause();
  Py_END_ALLOW_THREADS
  return 0;
}

void hold_from_handler() { Py_AddPendingCall(&hold_forever, nullptr); }

memprof::GradWatch make_grad_watch(const py::sequence& params) {
  std::vector<at::Tensor> tensors;
  tensors.reserve(py::len(params));
  for (const py::handle h : params) {
    if (!THPVariable_Check(h.ptr())) throw py::type_error("GradWatch takes tensors");
    tensors.push_back(THPVariable_Unpack(h.ptr()));
  }
  return memprof::GradWatch(std::move(tensors));
}

py::array_t<int64_t> changed_grads(memprof::GradWatch& watch) {
  const std::vector<memprof::GradBlock> blocks = watch.changed();
  py::array_t<int64_t> out({static_cast<py::ssize_t>(blocks.size()), py::ssize_t{5}});
  auto rows = out.mutable_unchecked<2>();
  for (size_t i = 0; i < blocks.size(); ++i) {
    const memprof::GradBlock& b = blocks[i];
    const auto r = static_cast<py::ssize_t>(i);
    rows(r, 0) = b.index;
    rows(r, 1) = b.ptr;
    rows(r, 2) = b.bytes;
    rows(r, 3) = b.device_type;
    rows(r, 4) = b.device_index;
  }
  return out;
}

py::tuple min_cut(const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& src,
                  const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& dst,
                  const py::array_t<double, py::array::c_style | py::array::forcecast>& cap, int64_t n, int64_t s,
                  int64_t t) {
  if (src.ndim() != 1 || dst.ndim() != 1 || cap.ndim() != 1 || src.size() != dst.size() || src.size() != cap.size()) {
    throw std::invalid_argument("min_cut takes three 1-d arrays of one length (sources, targets, capacities)");
  }
  memprof::MinCut cut;
  {
    py::gil_scoped_release release;
    cut = memprof::min_cut(n, src.data(), dst.data(), cap.data(), src.size(), s, t);
  }
  py::array_t<bool> sink(static_cast<py::ssize_t>(cut.sink_side.size()));
  std::copy(cut.sink_side.begin(), cut.sink_side.end(), sink.mutable_data());
  return py::make_tuple(cut.value, sink);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "memprof native capture core";
  m.def(
      "start",
      [](size_t max_events, unsigned scope_bits, int64_t first_step, int64_t last_step, size_t keep_last) {
        memprof::CaptureOptions options;
        options.max_events = max_events;
        options.scope_bits = scope_bits;
        options.first_step = first_step;
        options.last_step = last_step;
        options.keep_last = keep_last;
        memprof::start_capture(options);
      },
      py::arg("max_events"), py::arg("scope_bits"), py::arg("first_step") = 1,
      py::arg("last_step") = std::numeric_limits<int64_t>::max(), py::arg("keep_last") = 0);
  m.def("stop", &memprof::stop_capture, "Stop the active capture; returns a warning or ''.");
  m.def("active", &memprof::capture_active);
  m.def("events", &copy_events_to_numpy, "Events of the last capture as raw bytes (uint8).");
  m.def("strings", [] { return to_python(memprof::strings()); });
  m.def("event_count", &memprof::event_count, "Events recorded so far (or by the last capture).");
  m.def("events_range", &copy_events_range_to_numpy, py::arg("start"), py::arg("count"),
        "Events [start, start + count) as raw bytes, also while the capture runs (the spill).");
  m.def("release_events_before", &memprof::release_events_before, py::arg("n"),
        "Free the event chunks before event n (the spill holds them).");
  m.def("released_events", &memprof::released_events);
  m.def(
      "spill_events",
      [](int fd, size_t start, size_t count) {
        int64_t written = 0;
        {
          py::gil_scoped_release release;
          written = memprof::write_spill_records(fd, start, count);
        }
        if (written < 0) {
          errno = static_cast<int>(-written);
          PyErr_SetFromErrno(PyExc_OSError);
          throw py::error_already_set();
        }
        return written;
      },
      py::arg("fd"), py::arg("start"), py::arg("count"),
      "Append events [start, start + count) to the spill's descriptor as its event records, straight from "
      "the store (not with a ring); returns the events written.");
  m.def(
      "ring_head",
      [] {
        auto head = memprof::ring_head();
        const auto& carried = head.carried;
        py::array_t<uint8_t> out(static_cast<py::ssize_t>(carried.size() * sizeof(memprof::Event)));
        if (!carried.empty()) std::memcpy(out.mutable_data(), carried.data(), carried.size() * sizeof(memprof::Event));
        return py::make_tuple(head.start, out, context_to_python(head.context));
      },
      "With keep_last: (the ring's first stored event, the events carried into it as raw bytes, their "
      "scope context: [(index, [(scope, occurrence), ...], ordinal)]).");
  m.def("window_context", [] { return context_to_python(memprof::window_context()); },
        "With a step window that opened: the scope context of the blocks carried into it (as ring_head's).");
  m.def("freeze", &memprof::freeze_capture, "End the active capture from any thread (the process is dying).");
  memprof::set_hold_hook(&hold_from_handler);
  m.def("take_fatal_signals", &memprof::take_fatal_signals, py::arg("signals"), py::arg("hold"),
        "Catch these signals where their disposition is the default; returns those taken. With hold, a "
        "signal stops the main thread at its next bytecode.");
  m.def("give_back_fatal_signals", &memprof::give_back_fatal_signals);
  m.def("wait_fatal_signal", &memprof::wait_fatal_signal, py::arg("timeout_ms"),
        py::call_guard<py::gil_scoped_release>(), "A fatal signal that came (0: none within the timeout).");
  m.def("die_by_signal", &memprof::die_by_signal, py::arg("signum"), py::call_guard<py::gil_scoped_release>());
  m.def("hold_main_thread", [] { return Py_AddPendingCall(&hold_forever, nullptr) == 0; },
        "Stop the main thread at its next bytecode until the process dies.");
  m.def("window_state", &memprof::window_state);
  m.def("store_bytes", &memprof::store_bytes, "Memory the event store holds now (bytes).");
  m.def("strings_from", [](size_t first) { return to_python(memprof::strings_from(first)); },
        py::arg("first"));
  m.def("threads", [] {
    py::list out;
    for (const auto& t : memprof::thread_table()) {
      out.append(py::make_tuple(t.index, t.os_tid, t.name));
    }
    return out;
  });
  m.def("dropped", &memprof::dropped_events);
  m.def("first_dropped_ns", &memprof::first_dropped_ns);
  m.def("cpu_all_threads_problem", &memprof::cpu_all_threads_problem);
  m.def("max_events", &memprof::max_events);
  m.def("set_max_events", &memprof::set_max_events, py::arg("n"));
  m.def("start_ns", &memprof::capture_start_ns);
  m.def("stop_ns", &memprof::capture_stop_ns);
  m.def("release", &memprof::release);
  m.def("set_quiet", &memprof::set_quiet, py::arg("quiet"),
        "memprof's op scopes off (True) or on again on this thread; returns whether they were off.");
  m.def("quiet_scope", [](const std::string& name, bool begin) { return memprof::quiet_scope(name, begin); },
        py::arg("name"), py::arg("begin"),
        "While op scopes are off on this thread: record a scope's begin or end; returns whether it did.");
  m.def("mark_step", &memprof::mark_step);
  m.def("mark", [](const std::string& label) { memprof::mark(label); });
  m.def("now_ns", &memprof::now_ns);
  m.def("event_layout", &event_layout);
  m.def("min_cut", &min_cut, py::arg("src"), py::arg("dst"), py::arg("cap"), py::arg("n"), py::arg("s"), py::arg("t"),
        "A minimum s-t cut (Dinic): (value, per node whether it reaches t in the residual network).");
  m.def("constants", &constants);
  m.def("cuda_built", &memprof::cuda_built);
  m.def("attach_cuda_tracker", &memprof::attach_cuda_tracker);
  m.def("cuda_tracker_attached", &memprof::cuda_tracker_attached);
  m.def("shutdown", &memprof::shutdown);
  py::class_<memprof::GradWatch>(m, "GradWatch",
                                 "The gradients of some parameters, read at each optimizer step in C++.")
      .def(py::init(&make_grad_watch), py::arg("params"))
      .def("changed", &changed_grads,
           "int64 rows (parameter index, storage ptr, storage bytes, device type, device index) of the gradients "
           "that are other tensors than at the last call (ptr -1: read that one from Python)");
}
