#!/usr/bin/env bash
# Set up memprof in ./.venv: reuse the system's torch if it has one (e.g. a CUDA build),
# otherwise install torch 2.13.0 (CPU); then build memprof._C and install memprof editable.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv --system-site-packages .venv
py=.venv/bin/python
$py -c "import torch" 2>/dev/null || $py -m pip install -q torch==2.13.0
$py -m pip install -q "setuptools>=77" wheel
$py -m pip install -q --no-build-isolation -e ".[test]"
$py -c "import memprof._native as n, torch; n.native(); print('memprof ready: torch', torch.__version__, \
'(CUDA build)' if n.native().cuda_built() else '(CPU build)')"
