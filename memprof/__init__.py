"""memprof: exact memory profiling for PyTorch training under torch.compile.

    with memprof.capture() as cap:
        train_step()
    print(cap.peak("cuda:0"), cap.live_at_peak("cuda:0")[:5])
    cap.save("run.memprof")
"""

from __future__ import annotations

__version__ = "0.1.0"

from memprof.capture import Capture, LiveAllocation, active, capture, step
from memprof.errors import CaptureFileError, MemprofError, NativeUnavailable
from memprof.fileformat import load

__all__ = [
    "Capture",
    "CaptureFileError",
    "LiveAllocation",
    "MemprofError",
    "NativeUnavailable",
    "__version__",
    "active",
    "capture",
    "load",
    "step",
]
