"""A fake CUDA toolchain for builds through the real ninja: `nvcc` and `c++` are shell scripts
that check what they are given (every -I / -isystem / -L directory and every input must
exist, so a path that ninja or the shell split shows up) and write small output files.

Behaviour is steered by environment variables the build passes on to the compilers:
VG_FAKE_NVCC_SLEEP (seconds per compile), VG_FAKE_NVCC_FAIL (a source name part that fails
to compile), VG_FAKE_PIDS (a file the compilers append their pids to, and their sleep's),
VG_FAKE_NVCC_IGNORE_TERM (the compiler and its sleep ignore SIGTERM, as a stuck one might),
VG_FAKE_LINK_ENOSPC (the link fails as on a full disk, with ld's messages).
Like the real nvcc, the fake one hands the source's real path, the output path and TMPDIR to a
shell in double quotes: a path holding ``$(...)`` runs it there, as it would with nvcc.
nvcc prints the NVCC_APPEND_FLAGS and NVCC_CCBIN it was given into the build output.
Own module (no pytest import), so that spawned child processes can use it too.
"""

from __future__ import annotations

from pathlib import Path

from variantgen.build import builder as build
from variantgen.build.builder import FlashInferInfo, Toolchain

NVCC = r"""#!/bin/sh
[ -z "$VG_FAKE_NVCC_IGNORE_TERM" ] || trap '' TERM
out=""; dep=""; src=""
while [ $# -gt 0 ]; do
  case "$1" in
    --version) printf 'Cuda compilation tools, release 12.8, V12.8.93\n'; exit 0 ;;
    -o) out="$2"; shift ;;
    -MF) dep="$2"; shift ;;
    -ccbin) [ -x "$2" ] || { echo "fake nvcc: -ccbin $2: not an executable"; exit 3; }; shift ;;
    -c) src="$2"; shift ;;
    -isystem) [ -d "$2" ] || { echo "fake nvcc: -isystem $2: no such directory"; exit 3; }; shift ;;
    -I*) [ -d "${1#-I}" ] || { echo "fake nvcc: $1: no such directory"; exit 3; } ;;
  esac
  shift
done
[ -n "$VG_FAKE_PIDS" ] && echo $$ >> "$VG_FAKE_PIDS"
echo "fake nvcc: compiling $src"
[ -z "$NVCC_APPEND_FLAGS" ] || echo "fake nvcc: NVCC_APPEND_FLAGS=$NVCC_APPEND_FLAGS"
[ -z "$NVCC_CCBIN" ] || echo "fake nvcc: NVCC_CCBIN=$NVCC_CCBIN"
[ -f "$src" ] || { echo "fake nvcc: $src: no such file"; exit 3; }
# As the real nvcc does: its sub-tools run through a shell, with the source's real absolute path,
# the output path and the temporary folder in double quotes (where $VAR, $(...) and `...` expand).
# Only for sources in the build folder: the toolkit's own files may lie under odd test paths.
case "$src" in /*) ;; *)
  abs="$(pwd -P)/$src"
  sh -c "[ -f \"$abs\" ] && : \"$out\" \"${TMPDIR:-/tmp}/tmpxft\"" || {
    echo "fake nvcc: the sub-tools' shell did not find $abs"; exit 4; } ;;
esac
if [ -n "$VG_FAKE_NVCC_SLEEP" ]; then
  sleep "$VG_FAKE_NVCC_SLEEP" &
  [ -n "$VG_FAKE_PIDS" ] && echo $! >> "$VG_FAKE_PIDS"
  wait
fi
if [ -n "$VG_FAKE_NVCC_FAIL" ]; then
  case "$src" in *"$VG_FAKE_NVCC_FAIL"*) echo "$src(3): error: fake failure"; exit 2 ;; esac
fi
printf 'object of %s\n' "$src" > "$out"
[ -z "$dep" ] || printf '%s: \n' "$out" > "$dep"
"""

CXX = r"""#!/bin/sh
out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --version) echo "fake c++ 1.0"; exit 0 ;;
    -o) out="$2"; shift ;;
    -L*) [ -d "${1#-L}" ] || { echo "fake c++: $1: no such directory"; exit 3; } ;;
    *.o) [ -f "$1" ] || { echo "fake c++: $1: no such file"; exit 3; } ;;
  esac
  shift
done
echo "fake c++: linking $out"
if [ -n "$VG_FAKE_LINK_ENOSPC" ]; then  # what gcc and ld print when the disk fills during the link
  echo "/usr/bin/ld: final link failed: No space left on device"
  echo "collect2: error: ld returned 1 exit status"
  exit 1
fi
printf '\177ELF fake module\n' > "$out"
"""


def make_toolchain(root: Path) -> tuple[Toolchain, FlashInferInfo]:
    """Write the fake toolkit and FlashInfer tree under ``root`` (any path: spaces, $ and :
    included) and return what build.toolchain() / build.flashinfer_info() would."""
    cuda = root / "cuda home"
    for sub in ("bin", "include", "lib64"):
        (cuda / sub).mkdir(parents=True, exist_ok=True)
    (cuda / "include" / "cuda_runtime.h").write_text("")
    (cuda / "lib64" / "libcudart.so").write_bytes(b"")
    for name, text in (("nvcc", NVCC), ("c++", CXX)):
        script = cuda / "bin" / name
        if not script.is_file() or script.read_text() != text:  # as it is: processes may run it now
            script.write_text(text)
            script.chmod(0o755)
    fi = root / "flash infer"
    include, csrc, system = fi / "include", fi / "csrc", fi / "cutlass include"
    for d in (include, csrc, system):
        d.mkdir(parents=True, exist_ok=True)
    for host in ("batch_prefill_paged.cu", "batch_prefill_ragged.cu", "batch_decode.cu"):
        (csrc / host).write_text("// FlashInfer host code (fake)\n")
    cxx = str(cuda / "bin" / "c++")  # links, and is nvcc's host compiler (-ccbin)
    tc = Toolchain(cuda, cuda / "bin" / "nvcc", "V12.8.93", cxx, "fake c++ 1.0", cxx, "fake c++ 1.0")
    info = FlashInferInfo(version="0.7.2.post1", include_dirs=(include, csrc), system_include_dirs=(system,),
                          csrc_dir=csrc, tvm_ffi_version="0.1.15.post2")
    return tc, info


def patch(root: Path) -> Toolchain:
    """In this process: build with the fake toolchain under ``root`` (the real ninja runs)."""
    tc, info = make_toolchain(root)
    build.toolchain = lambda: tc  # type: ignore[assignment]
    build.flashinfer_info = lambda: info  # type: ignore[assignment]
    return tc


def build_in_child(tool_root: str, cache_root: str) -> None:
    """A builder process (killed by the parent midway through its compiles)."""
    from _cache_procs import causal_config

    from variantgen.build.cache import Cache

    patch(Path(tool_root))
    build.build_module(causal_config(), Cache(cache_root))


if __name__ == "__main__":  # python _fake_toolchain.py TOOL_ROOT ARGS...: the CLI over the fake toolchain
    import sys

    from variantgen.tools.cli import main

    patch(Path(sys.argv[1]))
    main(sys.argv[2:], prog_name="variantgen")
