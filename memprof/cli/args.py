"""Splitting `memprof trace|sweep [OPTIONS] SCRIPT [ARGS]...` into memprof's options and the script's
command line (a pure function: the commands' parsers call it, the tests check it).

The rule, as `memprof trace --help` states it:

- Before SCRIPT, every option is memprof's.
- After SCRIPT, memprof takes only its own options, written exactly as its names (`--budget 0.05`,
  `--budget=0.05`, `-o run.memprof`, `--force`); everything else stays the script's, in the order
  and form given. `--steps` after SCRIPT is memprof's only as a window A:B (`--steps 100` stays the
  script's), and `-h`/`--help` after SCRIPT are the script's.
- The first `--` after SCRIPT ends memprof's options: it is dropped and everything after it goes to
  the script verbatim, a further `--` included (`s.py x -- -- y` gives the script `['x', '--', 'y']`).
- `memprof trace [OPTIONS] -- SCRIPT ARGS...`: with `--` before SCRIPT, nothing after SCRIPT is
  memprof's (`-- s.py x -- y` gives `['x', '--', 'y']`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

_SCRIPTS_OWN = frozenset({"-h", "--help"})


@dataclass(frozen=True)
class Split:
    """A command line split: memprof's options (`before` SCRIPT, and `taken` from after it), SCRIPT,
    and the script's own arguments."""

    before: list[str]
    script: str | None
    script_args: list[str] = field(default_factory=list)
    taken: list[str] = field(default_factory=list)


def is_window(value: str) -> bool:
    """Whether `value` is a step window A:B (two whole numbers)."""
    first, sep, last = value.partition(":")
    return bool(sep) and first.strip().isdigit() and last.strip().isdigit()


def split_command(args: list[str], takes_value: Collection[str], flags: Collection[str],
                  windows: Collection[str] = ("--steps",), nargs: Mapping[str, int] | None = None) -> Split:
    """Split `args` (what follows the command's name) by the module's rule. `takes_value`: memprof's
    option names that take a value (`nargs`: those that take more than one, and how many); `flags`:
    those that take none; `windows`: options that are memprof's after SCRIPT only with an A:B value."""
    counts = nargs or {}
    at = 0
    while at < len(args):
        arg = args[at]
        if arg == "--":
            if at + 1 >= len(args):
                return Split(list(args), None)
            return Split(args[:at], args[at + 1], list(args[at + 2:]))
        if arg == "-" or not arg.startswith("-"):
            break
        at += 1 + counts.get(arg, 1) if arg in takes_value else 1
    if at >= len(args):
        return Split(list(args), None)
    before, script = args[:at], args[at]
    theirs: list[str] = []
    taken: list[str] = []
    rest = args[at + 1:]
    i = 0
    while i < len(rest):
        arg = rest[i]
        if arg == "--":
            theirs += rest[i + 1:]
            break
        name, eq, value = arg.partition("=")
        if arg in _SCRIPTS_OWN:
            theirs.append(arg)
        elif arg in flags:
            taken.append(arg)
        elif arg in takes_value:
            following = rest[i + 1] if i + 1 < len(rest) else None
            if arg in windows and (following is None or not is_window(following)):
                theirs.append(arg)
            else:
                n = counts.get(arg, 1)
                taken += [arg, *rest[i + 1:i + 1 + n]]
                i += n
        elif eq and name.startswith("--") and name in takes_value and (name not in windows or is_window(value)):
            taken.append(arg)
        else:
            theirs.append(arg)
        i += 1
    return Split(before, script, theirs, taken)
