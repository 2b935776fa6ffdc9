"""Errors memprof reports to users as one line (the CLI prints them without a traceback)."""

from __future__ import annotations

import unicodedata

# Longest error line the CLI prints: a value echoed from a hostile file must not flood the terminal
MAX_ERROR_LINE = 400


class MemprofError(Exception):
    """A problem with the user's input or environment, stated in one line."""


class CaptureFileError(MemprofError):
    """A .memprof file that cannot be read: missing, truncated, corrupt or of a newer format."""


class IncompleteCaptureError(MemprofError):
    """A figure asked of a capture that dropped events: the events after the first drop are missing,
    so its peak is only a lower bound (`Capture.peak(lower_bound=True)` returns that bound)."""


class SaveError(MemprofError):
    """A capture that could not be written (a full disk, a directory that went away): nothing
    partial is left at the path; the capture itself is still filled and usable."""


class NativeUnavailable(MemprofError):
    """The native extension memprof._C is not built or does not match the installed torch."""


def one_line(exc: BaseException) -> str:
    """`Type: message` of an exception, its first line only (the type alone when it has no message)."""
    return f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__


def printable(text: str, limit: int | None = None) -> str:
    """`text` safe for a terminal: control and format characters other than newline and tab
    (terminal escape sequences from a capture's strings above all) written as escapes; cut to
    `limit` characters with an ellipsis when given."""
    out = "".join(ch if ch in "\n\t" or unicodedata.category(ch) not in ("Cc", "Cf")
                  else ch.encode("unicode_escape").decode("ascii") for ch in text)
    if limit is not None and len(out) > limit:
        out = out[: limit - 1] + "…"
    return out
