#!/usr/bin/env bash
# The installed package, as a user gets it: build the wheel from the checkout's sources, install
# it into a fresh virtual environment with its declared dependencies only (no flashinfer, none of
# the test tools), and run every shipped spec there, away from the checkout, through the flex
# route (torch's FlexAttention on the CPU) and the command line: validate, explain, render, probe,
# check --backend flex. Exits non-zero at the first failure. CI runs it after the tests.
#
# torch comes from the source scripts/setup.sh uses (VARIANTGEN_TORCH_INDEX, PyTorch's CPU wheel
# index by default, else pip's configured sources), at the version .venv has, so pip finds it in
# its cache or local mirror. Takes about 5 minutes on 2 cores: installing torch, and torch tracing
# FlexAttention once per spec.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-python3}
VPY=${VPY:-.venv/bin/python}  # the project's environment: builds the wheel offline (its setuptools)
TORCH_INDEX=${VARIANTGEN_TORCH_INDEX-https://download.pytorch.org/whl/cpu}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/variantgen-wheel.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
start=$SECONDS
step() { echo "wheel check [$((SECONDS - start))s]: $*"; }

step "building the wheel from a copy of the sources"
mkdir -p "$WORK/src"
cp -r pyproject.toml README.md variantgen templates specs "$WORK/src/"
find "$WORK/src" -name __pycache__ -prune -exec rm -rf {} +
"$VPY" -m pip wheel -q "$WORK/src" --no-deps --no-build-isolation --no-index -w "$WORK/dist"
wheel=$(ls "$WORK"/dist/variantgen-*.whl)

step "a fresh venv: torch first (as setup.sh does: its CPU build on a machine without a GPU)"
"$PY" -m venv "$WORK/venv"
FPY=$WORK/venv/bin/python
torch_version=$("$VPY" -c "from importlib import metadata; print(metadata.version('torch'))")
torch_args=()
if ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; } && [ -n "$TORCH_INDEX" ] &&
    "$FPY" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1].rstrip('/') + '/torch/', timeout=5)" \
      "$TORCH_INDEX" 2>/dev/null; then
  torch_args=(--index-url "$TORCH_INDEX")
fi
"$FPY" -m pip install -q --no-compile --disable-pip-version-check ${torch_args[@]+"${torch_args[@]}"} "torch==$torch_version"

step "installing the wheel with its declared dependencies"
"$FPY" -m pip install -q --no-compile --disable-pip-version-check "$wheel"
for absent in flashinfer pytest; do  # the user's environment: nothing the project's setup adds
  if "$FPY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$absent') is None)"; then
    echo "wheel check: $absent is installed in the fresh venv; it must not be" >&2
    exit 1
  fi
done

# Away from the checkout: the installed package, its own templates and specs, a private cache.
RUN=$WORK/run
mkdir -p "$RUN"
cd "$RUN"
export VARIANTGEN_CACHE_DIR=$RUN/cache CUDA_VISIBLE_DEVICES=""
unset VARIANTGEN_TEMPLATE_DIR VARIANTGEN_DISABLE_JIT FLASHINFER_DISABLE_JIT PYTHONPATH
VG=$WORK/venv/bin/variantgen
# stderr must be free of torch's "Failed to initialize NumPy" (numpy missing) and of tracebacks
quiet() {
  local err=$WORK/stderr
  if ! "$@" 2>"$err"; then
    cat "$err" >&2
    echo "wheel check: failed: $*" >&2
    exit 1
  fi
  if grep -E "NumPy|Traceback" "$err" >&2; then
    echo "wheel check: unexpected stderr from: $*" >&2
    exit 1
  fi
}

step "the installed package is the one in the venv, with its own data"
quiet "$FPY" - "$WORK/venv" <<'EOF'
import sys
import variantgen
import variantgen.core.env as env

assert variantgen.__file__.startswith(sys.argv[1]), variantgen.__file__
assert not env.IN_CHECKOUT and str(env.SPECS_DIR).startswith(sys.argv[1]), env.SPECS_DIR
print(f"variantgen {variantgen.__version__} from {variantgen.__file__}")
EOF
names=$("$FPY" -c "import variantgen; print(' '.join(variantgen.shipped_specs()))")

step "CLI: specs, validate"
quiet "$VG" specs >/dev/null
# shellcheck disable=SC2086
quiet "$VG" validate $names
step "CLI: explain, render, probe, check --backend flex (mm_prefix)"
quiet "$VG" explain mm_prefix --qo 8 --kv 12 --arg ranges=5-8 >/dev/null
quiet "$VG" render mm_prefix --head-dim 128 --dtype bf16 --file all >/dev/null
quiet "$VG" probe mm_prefix --head-dim 64 --dtype bf16 --backend flex --kind prefill,decode,ragged >/dev/null
quiet "$VG" check mm_prefix --head-dim 64 --dtype bf16 --backend flex --batch-size 2 --qo-len 16 --kv-len 48

step "every shipped spec: explained, rendered (fa2, fa3) and run through the flex route against the reference"
quiet "$FPY" - <<'EOF'
import variantgen
from variantgen.tools import explain as ex
from variantgen.codegen.render import ModuleConfig, render_module
from variantgen.tools.check import run_check

failed = []
for name in variantgen.shipped_specs():
    spec = variantgen.resolve_spec(name)
    ex.render(ex.explain(spec, 8, 12, ex.resolve_args(spec, (), 8, 12, 1, 0)))
    for backend in ("fa2", "fa3"):
        if backend in spec.backends:
            render_module(ModuleConfig(spec, 128, 128, "bf16", "bf16", "bf16", "9.0a", backend))
    result = run_check(spec, head_dim=64, dtype="bf16", kv_dtype=None, o_dtype=None, backend="flex", batch_size=2,
                       qo_len=16, kv_len=48, num_qo_heads=4, num_kv_heads=2, page_size=8, planner=True, seed=0,
                       tol=2e-2, echo=lambda line: None)
    print(result.line(2, 4, 2))
    if not result.ok:
        failed.append(name)
if failed:
    raise SystemExit(f"mismatch against the reference: {', '.join(failed)}")
EOF
step "ok: the wheel runs every shipped spec in a fresh venv"
