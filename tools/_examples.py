"""The bundled examples (`examples/train_<model>.py`) as modules, for the tools that build their models."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def load_example(model: str) -> ModuleType:
    """`examples/train_<model>.py`, imported (its `build`, `PAPER` or `FULL`, `SMALL`; the zoo's also
    `loss_fn`, `layers`, `DTYPE`, with `examples/` on the path for their shared `_zoo` module)."""
    if str(ROOT / "examples") not in sys.path:
        sys.path.insert(0, str(ROOT / "examples"))
    spec = importlib.util.spec_from_file_location(f"train_{model}", ROOT / "examples" / f"train_{model}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
