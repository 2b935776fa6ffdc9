"""memprof: exact memory profiling for PyTorch training under torch.compile.

    with memprof.capture() as cap:
        train_step()
    print(cap.peak("cuda:0"), cap.live_at_peak("cuda:0")[:5])
    cap.save("run.memprof")
"""

from __future__ import annotations

from memprof._version import __version__
from memprof.capture import Capture, LiveAllocation, load
from memprof.capture_info import CaptureInfo
from memprof.errors import CaptureFileError, MemprofError, NativeUnavailable, SaveError
from memprof.recorder import active, capture, step

__all__ = [
    "Capture",
    "CaptureFileError",
    "CaptureInfo",
    "LiveAllocation",
    "MemprofError",
    "NativeUnavailable",
    "SaveError",
    "__version__",
    "active",
    "capture",
    "load",
    "step",
]
