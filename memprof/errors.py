"""Errors memprof reports to users as one line (the CLI prints them without a traceback)."""

from __future__ import annotations


class MemprofError(Exception):
    """A problem with the user's input or environment, stated in one line."""


class CaptureFileError(MemprofError):
    """A .memprof file that cannot be read: missing, truncated, corrupt or of a newer format."""


class NativeUnavailable(MemprofError):
    """The native extension memprof._C is not built or does not match the installed torch."""


def one_line(exc: BaseException) -> str:
    """`Type: message` of an exception, its first line only (the type alone when it has no message)."""
    return f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
