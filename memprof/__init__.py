"""memprof: exact memory profiling for PyTorch training under torch.compile.

    with memprof.capture() as cap:
        train_step()
    print(cap.peak("cuda:0"), cap.live_at_peak("cuda:0")[:5])
    cap.save("run.memprof")
"""

from __future__ import annotations

from memprof._version import __version__
from memprof.analysis.attribution import AttributionRow
from memprof.analysis.diff import CaptureDiff, DiffRow, diff
from memprof.analysis.timeline import StepStat, Timeline
from memprof.capture import Capture, LiveAllocation, load
from memprof.capture_info import CaptureInfo
from memprof.errors import CaptureFileError, IncompleteCaptureError, MemprofError, NativeUnavailable, SaveError
from memprof.recorder import active
from memprof.session import capture, step

__all__ = [
    "AttributionRow",
    "Capture",
    "CaptureDiff",
    "CaptureFileError",
    "CaptureInfo",
    "DiffRow",
    "IncompleteCaptureError",
    "LiveAllocation",
    "MemprofError",
    "NativeUnavailable",
    "SaveError",
    "StepStat",
    "Timeline",
    "__version__",
    "active",
    "capture",
    "diff",
    "load",
    "step",
]
