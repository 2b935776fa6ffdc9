"""The reporter registry: one dict drives `memprof report` and `memprof export --format`.

A reporter writes a capture, and where it can a distributed run's rank files (`Run`), to a file
object: text formats write `str`, binary ones (`binary`) `bytes`. Its options are a frozen
dataclass (`options`), so a command can tell which of its flags a format takes
(`Reporter.make_options`), and nothing is built in memory that the reporter can write as it goes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import IO, TYPE_CHECKING, Any, Generic, TypeVar

from memprof.errors import MemprofError

if TYPE_CHECKING:
    from memprof.capture import Capture

OptionsT = TypeVar("OptionsT")


@dataclass(frozen=True)
class Run:
    """A distributed run read from its rank files (`memprof.ranks.load_run`)."""

    name: str
    captures: Mapping[int, Capture]  # rank -> its capture
    world_size: int


@dataclass(frozen=True)
class Reporter(Generic[OptionsT]):
    name: str
    kind: str  # "report" (`memprof report`) or "export" (`memprof export --format`)
    suffix: str
    description: str
    options: type[OptionsT]  # a frozen dataclass whose fields all have defaults
    write: Callable[[Capture, OptionsT, IO[Any]], None]
    write_run: Callable[[Run, OptionsT, IO[Any]], None] | None = None  # None: one capture only
    binary: bool = False

    def make_options(self, **given: Any) -> OptionsT:
        """The options from keyword values (None: the default); a name the format does not take is
        a one-line error naming the flag."""
        names = {f.name for f in fields(self.options)}  # type: ignore[arg-type]
        for key, value in given.items():
            if key not in names and value is not None:
                raise MemprofError(f"--{key.replace('_', '-')} does not apply to --format {self.name}")
        return self.options(**{k: v for k, v in given.items() if v is not None and k in names})


REGISTRY: dict[str, Reporter[Any]] = {}


def register(reporter: Reporter[OptionsT]) -> Reporter[OptionsT]:
    if reporter.name in REGISTRY:
        raise ValueError(f"reporter {reporter.name!r} registered twice")
    REGISTRY[reporter.name] = reporter
    return reporter
