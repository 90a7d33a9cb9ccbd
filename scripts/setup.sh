#!/usr/bin/env bash
# Create .venv with everything variantgen and its tests need, from scratch, CPU-only.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# CPU torch first, so nothing later pulls a CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q --no-deps "flashinfer-python==0.7.2.post1" "apache-tvm-ffi==0.1.15.post2"
.venv/bin/python -m pip install -q numpy einops packaging requests tabulate tqdm click nvidia-ml-py ninja \
  jinja2 pyyaml filelock pytest hypothesis ruff
.venv/bin/python -m pip install -q --no-deps -e .
echo "variantgen installed in .venv"
