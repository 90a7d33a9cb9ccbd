#!/usr/bin/env bash
# Create .venv with everything variantgen and its tests need, from scratch.
#
# torch: on a machine without an NVIDIA GPU, the CPU-only build, from PyTorch's CPU wheel index
# (VARIANTGEN_TORCH_INDEX, default https://download.pytorch.org/whl/cpu; set it to a mirror, or
# to "" to use pip's own sources): on a stock pip, `torch==2.13.0` from PyPI is the CUDA build
# and pulls ~15 nvidia-* packages (several GB). Where the index does not answer within a few
# seconds (an offline box), pip's configured sources are used instead - they may hold a CPU
# wheel (a find-links folder, a mirror) - and the output says which source and which build.
# With a GPU (nvidia-smi lists one), pip's sources are used: there the CUDA build is wanted.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=torch==2.13.0
TORCH_INDEX=${VARIANTGEN_TORCH_INDEX-https://download.pytorch.org/whl/cpu}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip

# The installed torch as "VERSION cpu|cuda", or "" (from package metadata, without importing it).
torch_build() {
  "$VPY" - <<'EOF'
from importlib import metadata

try:
    dist = metadata.distribution("torch")
except metadata.PackageNotFoundError:
    print("")
else:
    print(dist.version, "cuda" if any(r.startswith("nvidia-") for r in dist.requires or []) else "cpu")
EOF
}

# Does the index have a torch page, answering within 5 s? (no route, no DNS, refused: no)
index_reachable() {
  "$VPY" - "$1" <<'EOF'
import os
import sys
import urllib.parse
import urllib.request

page = sys.argv[1].rstrip("/") + "/torch/"
try:
    if urllib.parse.urlsplit(page).scheme == "file":  # a local mirror: a folder per project
        if not os.path.isdir(urllib.request.url2pathname(urllib.parse.urlsplit(page).path)):
            raise FileNotFoundError(page)
    else:
        urllib.request.urlopen(page, timeout=5).close()
except Exception as e:
    print(f"torch: {sys.argv[1]} is not reachable ({type(e).__name__}: {e})", file=sys.stderr)
    sys.exit(1)
EOF
}

torch_args=()
want=cpu
have=$(torch_build)
have=${have%% *}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  want=any
  source_note="pip's configured sources (a GPU is present)"
elif [ "${have%%+*}" = "${TORCH#torch==}" ]; then
  source_note="the installed package"  # pip keeps it: nothing to fetch
elif [ -z "$TORCH_INDEX" ]; then
  source_note="pip's configured sources (VARIANTGEN_TORCH_INDEX is empty)"
elif index_reachable "$TORCH_INDEX"; then
  source_note="PyTorch's CPU wheel index $TORCH_INDEX"
  torch_args=(--index-url "$TORCH_INDEX")
else
  source_note="pip's configured sources (the CPU wheel index is not reachable)"
fi
"$VPY" -m pip install -q --no-warn-conflicts ${torch_args[@]+"${torch_args[@]}"} "$TORCH"
got=$(torch_build)
echo "torch ${got% *} (${got#* } build) from $source_note"
if [ "$want" = cpu ] && [ "${got#* }" = cuda ]; then
  echo "warning: this is torch's CUDA build, on a machine without a GPU; point VARIANTGEN_TORCH_INDEX at a" \
       "reachable CPU wheel index (or mirror), then: $VPY -m pip uninstall -y torch && bash scripts/setup.sh" >&2
fi

# variantgen (editable) with its test tools, and what `import flashinfer` needs at run time.
"$VPY" -m pip install -q --no-warn-conflicts -e ".[test]" numpy einops packaging requests tabulate nvidia-ml-py
# flashinfer-python and apache-tvm-ffi without their dependencies: FlashInfer's GPU-only ones
# (cuda-python, cuda-tile, nccl-extensions, nccl4py, nvidia-cudnn-frontend, nvidia-cutlass-dsl)
# are not needed to build or run variantgen modules. pip would report each of them, whenever it
# installs anything flashinfer depends on (torch, numpy, ...), as "pip's dependency resolver does
# not currently take into account all the packages that are installed ... flashinfer-python
# requires X, which is not installed": hence --no-warn-conflicts on every install here, and one
# `pip check` at the end that reports any other problem.
"$VPY" -m pip install -q --no-deps --no-warn-conflicts "flashinfer-python==0.7.2.post1" "apache-tvm-ffi==0.1.15.post2"
echo "flashinfer-python, apache-tvm-ffi: installed with --no-deps, without FlashInfer's GPU-only dependencies" \
     "(variantgen does not use them; \`pip check\` lists them as not installed)"
# A second FlashInfer, the newest variantgen was checked against, in a folder of its own
# (.fi/VERSION, not on the venv's path): the nvcc tests build modules against it too, since
# engines pin their own FlashInfer (tests/cpu/test_build_nvcc.py puts it first on sys.path in a
# subprocess). VARIANTGEN_SECOND_FLASHINFER=VERSION picks another; "" skips it.
FI_SECOND=${VARIANTGEN_SECOND_FLASHINFER-0.7.4}
if [ -n "$FI_SECOND" ] && [ ! -d ".fi/$FI_SECOND/flashinfer" ]; then
  "$VPY" -m pip install -q --no-deps --no-warn-conflicts --target ".fi/$FI_SECOND" "flashinfer-python==$FI_SECOND"
  echo "flashinfer-python $FI_SECOND: installed into .fi/$FI_SECOND for the build tests against a second version"
fi
gpu_only="cuda-python|cuda-tile|nccl-extensions|nccl4py|nvidia-cudnn-frontend|nvidia-cutlass-dsl"
known="^No broken requirements found|^flashinfer-python [^ ]+ requires ($gpu_only)([<>=!~][^,]*)?, which is not installed"
problems=$("$VPY" -m pip check 2>&1 | grep -v -E "$known" || true)
if [ -n "$problems" ]; then
  printf 'warning: pip check:\n%s\n' "$problems" >&2
fi
echo "variantgen installed in .venv"
