#!/usr/bin/env bash
# Set up memprof in ./.venv: reuse the system's torch if it has one (e.g. a CUDA build),
# otherwise install torch 2.13.0 (CPU); then build memprof._C and install memprof editable.
# Run again, it does nothing (in about a second) while the built extension is newer than csrc/,
# setup.py and pyproject.toml and the test tools are installed.
set -euo pipefail
cd "$(dirname "$0")/.."
# headless Chromium and its driver for the HTML report's browser tests (marked `browser`; they skip
# where none is installed): Debian's packages, installed where missing and this runs as root, in the
# background while the rest is set up
browser=""
if ! command -v chromedriver >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (
    export DEBIAN_FRONTEND=noninteractive
    apt_install() { apt-get install -y -q --no-install-recommends chromium chromium-driver >/tmp/memprof-apt.log 2>&1; }
    apt_install || { apt-get update -q >/tmp/memprof-apt.log 2>&1 && apt_install; } \
      || echo "memprof: chromium could not be installed (the browser tests will skip): see /tmp/memprof-apt.log"
  ) &
  browser=$!
fi
ready() {
  .venv/bin/python - <<'PY' 2>/dev/null
import importlib.metadata, pathlib, sys
import click, hypothesis, mypy, pytest, ruff, selenium, xdist  # noqa: F401  (the test tools)
importlib.metadata.version("memprof")
so = sorted(pathlib.Path("memprof").glob("_C*.so"))
sources = [*pathlib.Path("csrc").iterdir(), pathlib.Path("setup.py"), pathlib.Path("pyproject.toml")]
sys.exit(0 if so and all(p.stat().st_mtime <= so[0].stat().st_mtime for p in sources) else 1)
PY
}
if [ -x .venv/bin/python ] && ready; then
  [ -z "$browser" ] || wait "$browser"
  .venv/bin/python -c "import memprof._native as n, torch; n.native(); print('memprof ready (already built): torch', \
torch.__version__, '(CUDA build)' if n.native().cuda_built() else '(CPU build)')"
  exit 0
fi
python3 -m venv --system-site-packages .venv
py=.venv/bin/python
$py -c "import torch" 2>/dev/null || $py -m pip install -q torch==2.13.0
$py -m pip install -q "setuptools>=77" wheel
$py -m pip install -q --no-build-isolation -e ".[test]"
[ -z "$browser" ] || wait "$browser"
$py -c "import memprof._native as n, torch; n.native(); print('memprof ready: torch', torch.__version__, \
'(CUDA build)' if n.native().cuda_built() else '(CPU build)')"
