"""memprof's own lines on stderr while it runs a script: a script may close or replace sys.stderr
(and sys.stdout), which must change neither what it sees nor memprof's exit code."""

from __future__ import annotations

import contextlib
import os
import sys


def say(text: str) -> None:
    """Write `text` and a newline to stderr: `sys.stderr` while it is open, else file descriptor 2
    (the stream a script closed was made with closefd=False, so the descriptor is still there); a
    descriptor that is gone too loses the line, as it would lose Python's."""
    stream = sys.stderr
    try:
        if stream is not None and not stream.closed:
            stream.write(text + "\n")
            stream.flush()
            return
    except (ValueError, OSError, AttributeError):  # closed meanwhile, or not a real stream
        pass
    data = (text + "\n").encode("utf-8", "replace")
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(2, data):]


def flush_std() -> None:
    """Flush the standard streams as Python does at exit: a closed or broken one is left alone."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            if stream is not None and not stream.closed:
                stream.flush()
