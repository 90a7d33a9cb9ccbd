"""Cold-start build time of variantgen modules: per module, and per compile unit from ninja's log.

Each module of the chosen matrix (specs x --backend x --kind at one --head-dim / --dtype /
--arch) is built into a fresh, empty cache (VARIANTGEN_CACHE_DIR points at a new folder),
one module at a time so that each has the machine to itself. Per module this records the wall
time of build_module(), ninja's run, the CPU time of the compiler processes (user + sys, from
getrusage of this process's children) and, from ninja's ``.ninja_log`` (start / end of every
edge), a table of compile units: which unit is the long pole, and the sum of unit times
against the span they ran in (how many ran at once, and what share of the cores that was).

build.py deletes ``.ninja_log`` from the staging folder before it publishes a module, so the
log is copied out of the staging folder as each ninja run returns: ``NinjaLogCapture`` wraps
``variantgen.build.ninja.run`` (which build.py calls for every build) for the duration of the
benchmark. variantgen itself is not changed.

Options:

* ``--library``: also precompile every shipped spec (specs/*.yaml) for the same head dim,
  dtype and arch, ``--library-jobs`` modules at once, through ``variantgen precompile``
  (in this process, into a second fresh cache), and report the total wall time;
* ``--flashinfer``: also time FlashInfer's own cold JIT of its built-in fa3 (sm90a) batch
  prefill module, in a child process with a fresh FLASHINFER_WORKSPACE_BASE. With a Hopper GPU
  (route ``plan``) the first ``BatchPrefillWithPagedKVCacheWrapper(backend="fa3").plan()``
  is timed (compile + load); without one (route ``build``) the module ``plan()`` would compile
  (``gen_batch_prefill_module("fa3", ...)``) is built without loading it, which needs no GPU.

Writes JSON (commit, date, host CPUs, GPU, toolchain and package versions, every module's
times and unit table) to --out (default on a GPU machine: bench/results/compile-<date>-<gpu>.json;
without a GPU only with --out: CPU-box figures do not belong in bench/results), also into $OUT
when set, and prints a table. Exits with 1 and the compiler's first error when a build fails.

  python bench/bench_compile.py specs/mm_prefix.yaml --backend fa2 --head-dim 128 --dtype bf16 \\
      --arch 9.0a --out /tmp/compile.json
  python bench/bench_compile.py mm_prefix --backend fa3 --flashinfer --library --library-jobs 4
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import variantgen  # noqa: E402
from variantgen.core import env as vg_env  # noqa: E402
from variantgen.core.errors import VariantgenError  # noqa: E402

NINJA_LOG = ".ninja_log"
BUILD_NINJA = "build.ninja"


# ----------------------------------------------------------------------------- ninja's files


@dataclass(frozen=True)
class Edge:
    """One line of a ninja log: an output and when (ms after ninja started) its command ran."""

    start_ms: int
    end_ms: int
    output: str


def parse_ninja_log(text: str) -> tuple[list[Edge], int]:
    """The edges of the last ninja run recorded in ``text`` (a ``.ninja_log``, v5 or later:
    ``start<TAB>end<TAB>mtime<TAB>output<TAB>hash``), and how many runs the log holds.

    ninja appends an edge when its command finishes, with times relative to that ninja's start:
    within one run the end times never decrease, so a smaller end time starts the next run.
    An output listed twice in the last run keeps its last line. Comment, blank and malformed
    lines are skipped."""
    runs: list[list[Edge]] = []
    last_end = None
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split("\t")
        if len(fields) < 4:
            continue
        try:
            start, end = int(fields[0]), int(fields[1])
        except ValueError:
            continue
        if not runs or (last_end is not None and end < last_end):
            runs.append([])
        runs[-1].append(Edge(start, end, fields[3]))
        last_end = end
    if not runs:
        return [], 0
    latest: dict[str, Edge] = {}
    for edge in runs[-1]:
        latest.pop(edge.output, None)
        latest[edge.output] = edge
    return list(latest.values()), len(runs)


def _ninja_tokens(text: str) -> Iterator[tuple[str, bool]]:
    """Tokens of a ninja build line with ninja's escapes undone (``$ `` ``$:`` ``$$``), each with
    whether it ended at an unescaped colon (the end of the outputs)."""
    token, i = [], 0
    while i < len(text):
        c = text[i]
        if c == "$" and i + 1 < len(text):
            token.append(text[i + 1])
            i += 2
            continue
        if c == " ":
            if token:
                yield "".join(token), False
            token = []
        elif c == ":":
            yield "".join(token), True
            token = []
        else:
            token.append(c)
        i += 1
    if token:
        yield "".join(token), False


def parse_build_ninja(text: str) -> dict[str, tuple[str, list[str]]]:
    """output -> (rule, explicit inputs) for each ``build`` line of a build.ninja (continued
    lines joined)."""
    out: dict[str, tuple[str, list[str]]] = {}
    joined = re.sub(r"\$\n[ \t]*", "", text)  # ninja's line continuation
    for line in joined.splitlines():
        if not line.startswith("build "):
            continue
        outputs: list[str] = []
        rest: list[str] = []
        seen_colon = False
        for token, colon in _ninja_tokens(line[len("build "):]):
            if not seen_colon:
                if token and token != "|":
                    outputs.append(token)
                seen_colon = colon
            elif token:
                rest.append(token)
        if not seen_colon or not rest:
            continue
        rule, inputs = rest[0], []
        for token in rest[1:]:
            if token in ("|", "||", "|@"):
                break  # implicit and order-only dependencies follow
            inputs.append(token)
        for o in outputs:
            out[o] = (rule, inputs)
    return out


def unit_name(output: str, module_name: str = "") -> str:
    """A short name for an edge's output: its file name, without the module-name prefix
    FlashInfer puts on objects, without .o / .cuda.o; a linked module is 'link'."""
    name = Path(output).name
    if name.endswith(".so"):
        return "link"
    if module_name and name.startswith(module_name + "_"):
        name = name[len(module_name) + 1:]
    for suffix in (".cuda.o", ".o"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def unit_table(log_text: str, ninja_text: str = "", module_name: str = "") -> dict[str, Any]:
    """Per-unit timings of one module's build: units sorted by duration (longest first), each
    with its rule and source file, and how many runs the log held."""
    edges, runs = parse_ninja_log(log_text)
    rules = parse_build_ninja(ninja_text) if ninja_text else {}
    units = []
    for e in edges:
        rule, inputs = rules.get(e.output, (None, []))
        link = (rule is not None and "link" in rule) or e.output.endswith(".so")
        units.append({
            "name": unit_name(e.output, module_name),
            "output": e.output,
            "rule": rule,
            "link": link,
            "source": Path(inputs[0]).name if inputs and not link else None,
            "start_s": round(e.start_ms / 1000, 3),
            "end_s": round(e.end_ms / 1000, 3),
            "seconds": round((e.end_ms - e.start_ms) / 1000, 3),
        })
    units.sort(key=lambda u: (-u["seconds"], u["name"]))
    return {"units": units, "ninja_log_runs": runs}


def summarize(units: list[dict[str, Any]], *, slots: int | None) -> dict[str, Any]:
    """What a unit table says: compile units, their summed time against the span ninja ran them
    in (``parallelism``: units running at once on average; ``efficiency``: that over ``slots``,
    ninja's -j: how full ninja kept its slots), the long pole, and the share of the span that
    the long pole plus the link (which waits for every object) make: the part more cores would
    not shorten. How busy the cores were is the CPU time's part (core_utilization in the
    module's record): with -j above the core count, units run at once but slower."""
    if not units:
        return {"units": 0}
    compiles = [u for u in units if not u["link"]]
    links = [u for u in units if u["link"]]
    span = max(u["end_s"] for u in units) - min(u["start_s"] for u in units)
    unit_s = sum(u["seconds"] for u in units)
    pole = max(compiles, key=lambda u: u["seconds"]) if compiles else None
    link_s = sum(u["seconds"] for u in links)
    parallelism = unit_s / span if span > 0 else None
    out: dict[str, Any] = {
        "units": len(compiles),
        "unit_seconds": round(unit_s, 3),
        "compile_seconds": round(sum(u["seconds"] for u in compiles), 3),
        "link_seconds": round(link_s, 3),
        "span_s": round(span, 3),
        "parallelism": round(parallelism, 3) if parallelism is not None else None,
        "slots": slots,
        "efficiency": round(parallelism / slots, 3) if parallelism is not None and slots else None,
        "long_pole": pole["name"] if pole else None,
        "long_pole_s": pole["seconds"] if pole else None,
        "shortest_unit_s": min(u["seconds"] for u in compiles) if compiles else None,
    }
    if pole and span > 0:
        out["long_pole_plus_link_share"] = round((pole["seconds"] + link_s) / span, 3)
    return out


# ----------------------------------------------------------------------------- capturing logs


def ninja_jobs(cmd: list[str]) -> int | None:
    """The -j of a ninja command line (None: ninja's default)."""
    for i, arg in enumerate(cmd):
        if arg == "-j" and i + 1 < len(cmd):
            return int(cmd[i + 1])
        if arg.startswith("-j") and arg[2:].isdigit():
            return int(arg[2:])
    return None


def ninja_default_jobs(cores: int) -> int:
    """ninja's -j when none is given: cores + 2 (2 for one core, 3 for two)."""
    return 2 if cores <= 1 else 3 if cores == 2 else cores + 2


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass
class NinjaCapture:
    """One ninja run of a variantgen build, as NinjaLogCapture saw it."""

    uri: str
    cmd: list[str]
    started: float  # time.time()
    ended: float = 0.0
    seconds: float | None = None
    returncode: int | None = None
    timed_out: bool = False
    ninja_log: str = ""
    build_ninja: str = ""


@dataclass
class NinjaLogCapture:
    """While entered: every ``variantgen.build.ninja.run`` call (one per module build; precompile's
    threads included) also saves the staging folder's .ninja_log and build.ninja as it returns,
    before build.py deletes the log. ``runs``: uri -> NinjaCapture (the last run of a uri)."""

    runs: dict[str, NinjaCapture] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _original: Any = None

    def __enter__(self) -> NinjaLogCapture:
        from variantgen.build import builder as build
        from variantgen.build import ninja

        if getattr(build, "_ninja_run", None) is not ninja or not callable(getattr(ninja, "run", None)):
            raise RuntimeError("variantgen.build.builder no longer runs ninja through variantgen.build.ninja.run: "
                               "bench/bench_compile.py's NinjaLogCapture needs updating")
        self._original = ninja.run
        ninja.run = self._run
        return self

    def __exit__(self, *exc: object) -> None:
        from variantgen.build import ninja

        ninja.run = self._original

    def _run(self, cmd, *, cwd, **kwargs):
        staging = Path(cwd)
        record = NinjaCapture(uri=staging.name.split(".")[0], cmd=[str(c) for c in cmd], started=time.time())
        result = None
        try:
            result = self._original(cmd, cwd=cwd, **kwargs)
            return result
        finally:
            record.ended = time.time()
            if result is not None:
                record.seconds, record.returncode = result.seconds, result.returncode
                record.timed_out = bool(result.timed_out)
            for name, attr in ((NINJA_LOG, "ninja_log"), (BUILD_NINJA, "build_ninja")):
                with contextlib.suppress(OSError):
                    setattr(record, attr, (staging / name).read_text(errors="replace"))
            with self._lock:
                self.runs[record.uri] = record

    def find(self, uri_prefix: str) -> NinjaCapture | None:
        """The run of the module whose URI starts with ``uri_prefix`` + '_' (a failed build's too)."""
        with self._lock:
            found = [r for u, r in self.runs.items() if u.startswith(uri_prefix + "_")]
        return max(found, key=lambda r: r.started) if found else None


def children_cpu_s() -> float:
    """User + system CPU seconds of this process's finished, waited-for descendants (ninja
    waits for its compilers, build.py for ninja)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def capture_record(run: NinjaCapture | None, cores: int) -> dict[str, Any]:
    """The ninja part of a module's JSON record: -j, ninja's seconds and the unit table."""
    if run is None:
        return {"ninja": None, "units": [], "summary": {"units": 0}, "note": "ninja's run was not captured"}
    requested = ninja_jobs(run.cmd)
    jobs = requested or ninja_default_jobs(cores)
    table = unit_table(run.ninja_log, run.build_ninja)
    return {
        "ninja": {"jobs": jobs, "jobs_given": requested is not None, "seconds": _round(run.seconds),
                  "returncode": run.returncode, "timed_out": run.timed_out, "log_runs": table["ninja_log_runs"],
                  "log_found": bool(run.ninja_log)},
        "units": table["units"],
        "summary": summarize(table["units"], slots=jobs),
    }


def cpu_figures(cpu_s: float, wall_s: float, cores: int) -> dict[str, float | None]:
    """CPU seconds per wall second (cores busy on average), and that over the usable cores."""
    if wall_s <= 0:
        return {"cpu_per_wall": None, "core_utilization": None}
    return {"cpu_per_wall": round(cpu_s / wall_s, 3), "core_utilization": round(cpu_s / wall_s / cores, 3)}


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


# ----------------------------------------------------------------------------- environment


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version_line(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    text = (out.stdout or out.stderr).strip()
    return text.splitlines()[0] if text else None


def environment() -> dict[str, Any]:
    """Where and with what the figures were measured: variantgen.testing.harness.run_environment()
    (date, GPU, torch, CUDA, flashinfer, variantgen, host, nvcc) plus the commit, the time,
    the CPUs and the toolchain a build uses."""
    try:
        from variantgen.testing.harness import run_environment

        env = run_environment()
    except Exception as e:  # noqa: BLE001 - a missing package is recorded, not fatal here
        env = {"date": datetime.date.today().isoformat(), "gpu": "unknown", "variantgen": variantgen.__version__,
               "host": platform.node(), "environment_error": f"{type(e).__name__}: {e}"}
    from variantgen.testing.harness import source_commit

    env = {"commit": source_commit(), **env,
           "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "cpu_count": os.cpu_count(), "cpus_usable": usable_cores(), "cpu_model": cpu_model(),
           "python": platform.python_version()}
    try:
        from variantgen.build import builder as build

        tc = build.toolchain()
        env.update(cuda_home=str(tc.cuda_home), nvcc_version=tc.nvcc_version, cxx=tc.cxx_version)
    except Exception as e:  # noqa: BLE001 - the build that follows reports the real error
        env["toolchain_error"] = str(e)
    ninja = shutil.which("ninja") or str(Path(sys.executable).parent / "ninja")  # where build.py looks
    env["ninja"] = _version_line([ninja, "--version"])
    try:
        from variantgen.codegen.fi_versions import package_versions

        env["tvm_ffi"] = package_versions()[1]
    except Exception:  # noqa: BLE001
        env["tvm_ffi"] = None
    s = vg_env.settings()
    env["nvcc_threads"] = s.nvcc_threads
    return env


def has_gpu() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - no usable GPU is a normal answer here
        return False


def default_arch() -> str:
    """VARIANTGEN_ARCH, else the visible GPU's arch, else 9.0a."""
    from variantgen.routing.capabilities import canonical_arch

    s = vg_env.settings()
    if s.arch:
        return canonical_arch(s.arch)
    if has_gpu():
        import torch

        major, minor = torch.cuda.get_device_capability()
        return canonical_arch(f"{major}.{minor}{'a' if major == 9 else ''}")
    return "9.0a"


# ----------------------------------------------------------------------------- variantgen builds


class BenchError(Exception):
    """A build failed or could not start; the message says why (printed, exit status 1)."""


@contextlib.contextmanager
def fresh_cache(path: Path) -> Iterator[Path]:
    """VARIANTGEN_CACHE_DIR = ``path`` (created; it must be new or empty) while inside."""
    if path.exists() and any(path.iterdir()):
        raise BenchError(f"cache dir {path} is not empty: a cold build needs an empty one")
    path.mkdir(parents=True, exist_ok=True)
    before = os.environ.get("VARIANTGEN_CACHE_DIR")
    os.environ["VARIANTGEN_CACHE_DIR"] = str(path)
    vg_env.reload_settings()
    try:
        yield path
    finally:
        if before is None:
            os.environ.pop("VARIANTGEN_CACHE_DIR", None)
        else:
            os.environ["VARIANTGEN_CACHE_DIR"] = before
        vg_env.reload_settings()


def module_configs(specs: list[str], *, backends: list[str], kinds: list[str], head_dim: tuple[int, int],
                   dtype: str, arch: str, with_planner: bool) -> tuple[list[Any], list[tuple[str, str]]]:
    """The modules to build (variantgen precompile's matrix) and the skipped combinations."""
    from variantgen.tools.cli_build import expand_matrix

    configs, skipped = expand_matrix(specs, [head_dim], [dtype], None, None, [arch], backends, kinds)
    if with_planner:
        from variantgen.planning.rowplan import planner_configs

        configs = [*configs, *planner_configs(configs)]
    return configs, skipped


def describe_config(cfg: Any) -> dict[str, Any]:
    d = dict(cfg.describe())
    d.pop("spec_file", None)
    return {"uri_prefix": cfg.uri_prefix, **d}


def build_one(cfg: Any, cache: Any, capture: NinjaLogCapture, *, jobs: int | None, cores: int) -> dict[str, Any]:
    """Build ``cfg`` into the (empty) ``cache``; its JSON record. BenchError on a failure (the
    record, with what ninja finished, is in its ``record`` attribute)."""
    from variantgen.build import builder as build

    cpu0, t0 = children_cpu_s(), time.perf_counter()
    error = None
    try:
        result = build.build_module(cfg, cache, jobs=jobs)
    except (VariantgenError, OSError) as e:
        result, error = None, e
    wall = time.perf_counter() - t0
    cpu = children_cpu_s() - cpu0
    run = capture.find(cfg.uri_prefix)
    record = {**describe_config(cfg), "uri": result.entry.uri if result else (run.uri if run else None),
              "wall_s": round(wall, 3), "cpu_s": round(cpu, 3), **cpu_figures(cpu, wall, cores),
              **capture_record(run, cores)}
    ninja_s = (record.get("ninja") or {}).get("seconds")
    record["outside_ninja_s"] = round(wall - ninja_s, 3) if ninja_s is not None else None  # render, key, publish
    if error is not None:
        record["error"] = str(error)
        exc = BenchError(f"building {cfg.uri_prefix} failed: {error}")
        exc.record = record  # type: ignore[attr-defined]
        raise exc
    if not result.built:
        raise BenchError(f"{result.entry.uri} was found in the cache {cache.root}, not built: not a cold build")
    return record


def build_modules(configs: list[Any], cache_dir: Path, *, jobs: int | None, cores: int,
                  records: list[dict[str, Any]]) -> None:
    """Cold-build each config, one after another, into ``cache_dir``; records appended as they
    finish (a failed one too, then BenchError)."""
    from variantgen.build.cache import Cache

    with fresh_cache(cache_dir), NinjaLogCapture() as capture:
        cache = Cache(cache_dir)
        for cfg in configs:
            print(f"building {cfg.uri_prefix} ...", file=sys.stderr, flush=True)
            try:
                records.append(build_one(cfg, cache, capture, jobs=jobs, cores=cores))
            except BenchError as e:
                if hasattr(e, "record"):
                    records.append(e.record)
                raise
            m = records[-1]
            print(f"  {m['wall_s']:.1f} s wall, {m['cpu_s']:.1f} CPU-s", file=sys.stderr, flush=True)


def build_library(args: argparse.Namespace, arch: str, cache_dir: Path, cores: int) -> dict[str, Any]:
    """``variantgen precompile`` of every shipped spec for one head dim / dtype / arch, in this
    process (so that each module's ninja log is captured), into an empty cache."""
    import click

    from variantgen.lang.library import shipped_specs
    from variantgen.tools.cli import main as cli_main

    specs = [str(p) for _, p in sorted(shipped_specs().items())]
    argv = ["precompile", *specs, "--head-dim", args.head_dim, "--dtype", args.dtype, "--arch", arch,
            "--backend", args.library_backend, "--kind", args.kind, "-j", str(args.library_jobs),
            "--cache-dir", str(cache_dir)]
    if args.jobs:
        argv += ["--jobs-per-module", str(args.jobs)]
    print(f"precompiling the library: variantgen {' '.join(argv)}", file=sys.stderr, flush=True)
    with fresh_cache(cache_dir), NinjaLogCapture() as capture:
        cpu0, t0, started = children_cpu_s(), time.perf_counter(), time.time()
        try:
            rc = cli_main.main(args=argv, prog_name="variantgen", standalone_mode=False)
        except SystemExit as e:  # precompile exits with 1 when a module failed
            rc = e.code
        except click.ClickException as e:
            rc, message = e.exit_code, e.format_message()
            print(f"error: {message}", file=sys.stderr)
        wall = time.perf_counter() - t0
        cpu = children_cpu_s() - cpu0
    rc = 0 if rc in (None, 0) else int(rc) if isinstance(rc, int) else 1
    modules = []
    for run in sorted(capture.runs.values(), key=lambda r: r.started):
        rec = capture_record(run, cores)
        modules.append({"uri": run.uri, "start_offset_s": round(run.started - started, 3),
                        "end_offset_s": round(run.ended - started, 3), **rec})
    failed = [m["uri"] for m in modules if m["ninja"] and m["ninja"]["returncode"] != 0]
    unit_s = sum(m["summary"].get("unit_seconds", 0.0) for m in modules)
    return {
        "command": ["variantgen", *argv],
        "specs": len(specs),
        "backend": args.library_backend,
        "kinds": args.kind,
        "jobs": args.library_jobs,
        "jobs_per_module": args.jobs or ninja_default_jobs(cores),
        "jobs_per_module_given": bool(args.jobs),
        "exit_status": rc,
        "modules_built": len(modules) - len(failed),
        "modules_failed": failed,
        "wall_s": round(wall, 3),
        "cpu_s": round(cpu, 3),
        **cpu_figures(cpu, wall, cores),
        "unit_seconds": round(unit_s, 3),
        "parallelism": round(unit_s / wall, 3) if wall else None,
        "modules": modules,
    }


# ----------------------------------------------------------------------------- FlashInfer's JIT

FLASHINFER_CHILD = r"""
import json, os, resource, sys, time
route, backend, dtype_name, hd_qk, hd_vo = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])

def cpu():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime

t0 = time.perf_counter()
import torch
import flashinfer
from flashinfer.jit import env as jit_env
from flashinfer.jit.attention.modules import gen_batch_prefill_module, get_batch_prefill_uri
dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
out = {"route": route, "flashinfer": flashinfer.__version__, "import_s": time.perf_counter() - t0,
       "jit_dir": str(jit_env.FLASHINFER_JIT_DIR)}
args = (dtype, dtype, dtype, torch.int32, hd_qk, hd_vo, 0, False, False, False)
out["module"] = get_batch_prefill_uri(backend, *args)
spec = gen_batch_prefill_module(backend, *args)
out["is_aot"] = bool(spec.is_aot)
out["build_dir"] = str(spec.build_dir)
cpu0, t1 = cpu(), time.perf_counter()
if route == "plan":
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
    i32 = dict(dtype=torch.int32, device="cuda")
    w.plan(torch.tensor([0, 16], **i32), torch.tensor([0, 1], **i32), torch.tensor([0], **i32),
           torch.tensor([16], **i32), 8, 8, hd_qk, 16, head_dim_vo=hd_vo, causal=True, q_data_type=dtype,
           kv_data_type=dtype)
    torch.cuda.synchronize()
else:
    spec.build(verbose=False)
out["seconds"] = time.perf_counter() - t1
out["cpu_s"] = cpu() - cpu0
print("FLASHINFER_RESULT " + json.dumps(out))
"""


def flashinfer_route(requested: str, arch: str) -> tuple[str | None, str]:
    """(route, note): 'plan' with a visible sm90 GPU, else 'build'; None (with the reason) when
    the requested route cannot run here."""
    from variantgen.routing.capabilities import canonical_arch

    if canonical_arch(arch) != "9.0a":
        return None, f"FlashInfer's fa3 prefill module is built for sm90a only (--arch is {arch})"
    gpu = has_gpu()
    sm90 = False
    if gpu:
        import torch

        sm90 = torch.cuda.get_device_capability()[0] == 9
    if requested == "plan" and not sm90:
        why = "no CUDA GPU is visible" if not gpu else "the visible GPU is not sm90"
        return None, (f"route 'plan' needs a Hopper GPU ({why}): BatchPrefillWithPagedKVCacheWrapper(backend='fa3')"
                      ".plan() allocates its workspace on the GPU; use --flashinfer-route build to time the "
                      "module's build alone")
    if requested == "build" or not sm90:
        note = ("no sm90 GPU visible: " if requested == "auto" else "") + (
            "timed gen_batch_prefill_module('fa3', ...).build(), the module plan() compiles, without plan() or "
            "loading it")
        return "build", note
    return "plan", "timed the first BatchPrefillWithPagedKVCacheWrapper(backend='fa3').plan() (JIT build + load)"


def flashinfer_jit(args: argparse.Namespace, arch: str, workdir: Path, cores: int) -> dict[str, Any]:
    """FlashInfer's cold JIT of its fa3 batch prefill module (q = kv = o = --dtype, int32
    indices, no RoPE / window / soft cap), in a child process with an empty workspace."""
    route, note = flashinfer_route(args.flashinfer_route, arch)
    if route is None:
        return {"skipped": note}
    from variantgen.routing.capabilities import canonical_dtype

    dtype = canonical_dtype(args.dtype, "--dtype")
    if dtype not in ("bf16", "fp16"):
        return {"skipped": f"--dtype {args.dtype}: the comparison builds bf16 or fp16 modules"}
    qk, vo = parse_head_dim(args.head_dim)
    if workdir.exists() and any(workdir.iterdir()):
        raise BenchError(f"FlashInfer workspace {workdir} is not empty: a cold JIT needs an empty one")
    workdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, FLASHINFER_WORKSPACE_BASE=str(workdir))
    env.pop("FLASHINFER_DISABLE_JIT", None)
    if route == "build":
        env["FLASHINFER_CUDA_ARCH_LIST"] = "9.0a"  # what a Hopper GPU would give; none is visible
    if args.jobs:
        env["MAX_JOBS"] = str(args.jobs)  # FlashInfer's ninja -j
    if not env.get("CUDA_HOME"):
        with contextlib.suppress(Exception):
            from variantgen.build import builder as build

            env["CUDA_HOME"] = str(build.toolchain().cuda_home)  # the nvcc variantgen's builds use
    cmd = [sys.executable, "-c", FLASHINFER_CHILD, route, "fa3", dtype, str(qk), str(vo)]
    print(f"FlashInfer fa3 prefill module, route {route} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    found = [line for line in proc.stdout.splitlines() if line.startswith("FLASHINFER_RESULT ")]
    if proc.returncode or not found:
        tail = (proc.stderr or proc.stdout).strip()[-2000:]
        return {"route": route, "note": note, "error": f"FlashInfer's JIT failed (exit {proc.returncode}):\n{tail}",
                "process_wall_s": round(wall, 3)}
    child = json.loads(found[-1][len("FLASHINFER_RESULT "):])
    record: dict[str, Any] = {
        "route": route, "note": note, "flashinfer": child["flashinfer"], "module": child["module"],
        "is_aot": child["is_aot"], "jit_dir": child["jit_dir"], "import_s": round(child["import_s"], 3),
        "wall_s": round(child["seconds"], 3), "cpu_s": round(child["cpu_s"], 3),
        **cpu_figures(child["cpu_s"], child["seconds"], cores),
        "process_wall_s": round(wall, 3), "max_jobs": env.get("MAX_JOBS"),
        "nvcc_threads": env.get("FLASHINFER_NVCC_THREADS", "1"),
    }
    if child["is_aot"] and route == "plan":
        record["note"] += "; an AOT copy of the module is installed, so plan() may have loaded it without JIT"
    jobs = int(env["MAX_JOBS"]) if env.get("MAX_JOBS") else ninja_default_jobs(cores)
    record["modules"] = []
    for log in sorted(Path(child["jit_dir"]).glob(f"*/{NINJA_LOG}")):
        build_dir = log.parent
        ninja_text = (build_dir / BUILD_NINJA).read_text() if (build_dir / BUILD_NINJA).is_file() else ""
        table = unit_table(log.read_text(errors="replace"), ninja_text, module_name=build_dir.name)
        ninja = {"jobs": jobs, "jobs_given": bool(env.get("MAX_JOBS")), "log_runs": table["ninja_log_runs"]}
        record["modules"].append({"module": build_dir.name, "ninja": ninja, "units": table["units"],
                                  "summary": summarize(table["units"], slots=jobs)})
    return record


# ----------------------------------------------------------------------------- report


def parse_head_dim(text: str) -> tuple[int, int]:
    qk, _, vo = str(text).partition("/")
    try:
        return int(qk), int(vo or qk)
    except ValueError:
        raise SystemExit(f"--head-dim {text!r}: expected a whole number or QK/VO, e.g. 128 or 192/128") from None


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.0f}%"


def unit_lines(units: list[dict[str, Any]], summary: dict[str, Any], indent: str = "  ") -> list[str]:
    """A module's unit table (longest first) and its summary line."""
    if not units:
        return [f"{indent}(no ninja log)"]
    width = max(12, *(len(u["name"]) for u in units))
    lines = [f"{indent}{'unit':<{width}}  {'start s':>8}  {'end s':>8}  {'seconds':>8}"]
    for u in units:
        mark = "  <- long pole" if u["name"] == summary.get("long_pole") and not u["link"] else ""
        lines.append(f"{indent}{u['name']:<{width}}  {u['start_s']:8.1f}  {u['end_s']:8.1f}  {u['seconds']:8.1f}{mark}")
    s = summary
    eff = f"{_pct(s.get('efficiency'))} of ninja's {s['slots']} slots"
    lines.append(f"{indent}{s['units']} compile units: {_fmt(s['unit_seconds'])} unit-s in a {_fmt(s['span_s'])} s "
                 f"span = {_fmt(s['parallelism'], '.2f')} at once ({eff}); long pole {s['long_pole']} "
                 f"{_fmt(s['long_pole_s'])} s + link {_fmt(s['link_seconds'])} s = "
                 f"{_fmt((s.get('long_pole_plus_link_share') or 0) * 100, '.0f')}% of the span")
    return lines


def report(result: dict[str, Any]) -> str:
    e = result["environment"]
    lines = [f"bench_compile  commit {e.get('commit')}  {e.get('measured_at')}  host {e.get('host')}: "
             f"{e.get('cpus_usable')} usable of {e.get('cpu_count')} CPUs ({e.get('cpu_model')}), GPU {e.get('gpu')}",
             f"  nvcc {e.get('nvcc_version')}  ninja {e.get('ninja')}  flashinfer {e.get('flashinfer')}  "
             f"torch {e.get('torch')}  variantgen {e.get('variantgen')}  nvcc --threads {e.get('nvcc_threads')}"]
    for label, reason in result.get("skipped", []):
        lines.append(f"skipped {label}: {reason}")
    for m in result["modules"]:
        n = m.get("ninja") or {}
        lines += ["", f"{m.get('uri') or m['uri_prefix']}",
                  f"  wall {m['wall_s']:.1f} s (ninja {_fmt(n.get('seconds'))} s, -j {n.get('jobs')}"
                  f"{'' if n.get('jobs_given') else ' = ninja default'}), CPU {m['cpu_s']:.1f} s "
                  f"= {_fmt(m.get('cpu_per_wall'), '.2f')} x wall ({_pct(m.get('core_utilization'))} of "
                  f"{e.get('cpus_usable')} cores); outside ninja (render, key, publish) "
                  f"{_fmt(m.get('outside_ninja_s'), '.2f')} s"]
        if m.get("error"):
            lines.append(f"  FAILED: {m['error']}")
        lines += unit_lines(m["units"], m["summary"])
    lib = result.get("library")
    if lib:
        lines += ["", f"library: {lib['specs']} specs, backend {lib['backend']}, kind {lib['kinds']}: "
                      f"{lib['modules_built']} modules built ({len(lib['modules_failed'])} failed) with "
                      f"{lib['jobs']} at once x ninja -j {lib['jobs_per_module']}: wall {lib['wall_s']:.1f} s, "
                      f"CPU {lib['cpu_s']:.1f} s ({_pct(lib['core_utilization'])} of {e.get('cpus_usable')} cores), "
                      f"{lib['unit_seconds']:.1f} unit-s = {_fmt(lib['parallelism'], '.2f')} units at once"]
        width = max([40, *(len(m["uri"]) for m in lib["modules"])])
        lines.append(f"  {'module':<{width}}  {'from s':>7}  {'to s':>7}  {'units':>5}  long pole")
        for m in lib["modules"]:
            s = m["summary"]
            lines.append(f"  {m['uri']:<{width}}  {m['start_offset_s']:7.1f}  {m['end_offset_s']:7.1f}  "
                         f"{s.get('units', 0):5d}  {s.get('long_pole')} {_fmt(s.get('long_pole_s'))} s")
    fi = result.get("flashinfer")
    if fi:
        lines.append("")
        if "skipped" in fi:
            lines.append(f"FlashInfer fa3 prefill: skipped: {fi['skipped']}")
        elif "error" in fi:
            lines.append(f"FlashInfer fa3 prefill: FAILED: {fi['error']}")
        else:
            lines.append(f"FlashInfer {fi['flashinfer']} fa3 prefill {fi['module']} (route {fi['route']}: "
                         f"{fi['note']})")
            lines.append(f"  wall {fi['wall_s']:.1f} s, CPU {fi['cpu_s']:.1f} s = "
                         f"{_fmt(fi['cpu_per_wall'], '.2f')} x wall ({_pct(fi['core_utilization'])} of "
                         f"{e.get('cpus_usable')} cores)")
            for m in fi["modules"]:
                if len(fi["modules"]) > 1:
                    lines.append(f"  {m['module']}")
                lines += unit_lines(m["units"], m["summary"])
    return "\n".join(lines)


def write_json(result: dict[str, Any], out: str | None) -> list[Path]:
    """--out (or bench/results/compile-<date>-<gpu>.json on a GPU machine) and $OUT/compile-bench.json."""
    text = json.dumps(result, indent=1) + "\n"
    paths = []
    if out:
        paths.append(Path(out))
    elif result["environment"].get("gpu") not in (None, "none", "unknown"):
        from variantgen.testing.harness import result_file_name

        paths.append(ROOT / "bench" / "results" / result_file_name("compile", result["environment"]))
    if os.environ.get("OUT"):
        paths.append(Path(os.environ["OUT"]) / "compile-bench.json")
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return paths


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("specs", nargs="*", help="spec files or shipped spec names (e.g. specs/mm_prefix.yaml, causal)")
    ap.add_argument("--backend", default="fa2", help="fa2, fa3 or auto, comma list (default fa2)")
    ap.add_argument("--kind", default="prefill", help="prefill, decode, ragged, comma list (default prefill)")
    ap.add_argument("--head-dim", default="128", help="QK head dim, or QK/VO (default 128)")
    ap.add_argument("--dtype", default="bf16", help="q = kv = o dtype (default bf16)")
    ap.add_argument("--arch", default=None, help="target arch (default: VARIANTGEN_ARCH, else the GPU's, else 9.0a)")
    ap.add_argument("-j", "--jobs", type=int, default=None,
                    help="ninja -j within one module (default: VARIANTGEN_BUILD_JOBS / MAX_JOBS, else ninja's: "
                         "cores + 2); also FlashInfer's MAX_JOBS")
    ap.add_argument("--with-planner", action="store_true",
                    help="also build each prefill spec's planner module (a cold make_wrapper on CUDA builds it too)")
    ap.add_argument("--library", action="store_true",
                    help="also precompile every shipped spec (specs/*.yaml) for --head-dim/--dtype/--arch")
    ap.add_argument("--library-jobs", type=int, default=2, help="modules built at once by --library (default 2)")
    ap.add_argument("--library-backend", default="auto", help="--backend of the --library precompile (default auto)")
    ap.add_argument("--flashinfer", action="store_true",
                    help="also time FlashInfer's cold JIT of its fa3 (sm90a) batch prefill module")
    ap.add_argument("--flashinfer-route", choices=("auto", "plan", "build"), default="auto",
                    help="plan: time the first fa3 wrapper plan() (needs a Hopper GPU); build: build the module "
                         "without loading it (no GPU needed); auto: plan where possible (default)")
    ap.add_argument("--cache-dir", default=None,
                    help="folder for the fresh caches: its modules/, library/ and flashinfer/ must be new or empty "
                         "(default: a new temporary folder)")
    ap.add_argument("--keep", action="store_true",
                    help="keep the caches and FlashInfer's workspace afterwards (they are kept after a failure)")
    ap.add_argument("--out", default=None, help="JSON file to write (see the module docstring for the default)")
    args = ap.parse_args(argv)
    if not args.specs and not args.library and not args.flashinfer:
        ap.error("nothing to build: give specs, --library or --flashinfer")
    if (args.jobs is not None and args.jobs < 1) or args.library_jobs < 1:
        ap.error("-j and --library-jobs take a number >= 1")
    return args


def _csv(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def run(args: argparse.Namespace) -> tuple[dict[str, Any], str | None]:
    """The benchmark; (result, error message or None). Builds stop at the first failure."""
    from variantgen.routing.capabilities import canonical_arch, canonical_dtype

    arch = canonical_arch(args.arch) if args.arch else default_arch()
    cores = usable_cores()
    qk, vo = parse_head_dim(args.head_dim)
    result: dict[str, Any] = {
        "bench": "compile",
        "environment": environment(),
        "matrix": {"specs": args.specs, "backends": _csv(args.backend), "kinds": _csv(args.kind),
                   "head_dim": [qk, vo], "dtype": canonical_dtype(args.dtype, "--dtype"), "arch": arch,
                   "with_planner": args.with_planner},
        "jobs_per_module": args.jobs or vg_env.settings().build_jobs,
        "modules": [],
        "skipped": [],
        "library": None,
        "flashinfer": None,
    }
    root = Path(args.cache_dir) if args.cache_dir else Path(tempfile.mkdtemp(prefix="vg-cold-"))
    result["cache_root"] = str(root)
    error = None
    try:
        if args.specs:
            configs, skipped = module_configs(args.specs, backends=_csv(args.backend), kinds=_csv(args.kind),
                                              head_dim=(qk, vo), dtype=args.dtype, arch=arch,
                                              with_planner=args.with_planner)
            result["skipped"] = [list(s) for s in skipped]
            if not configs:
                raise BenchError("no module of the matrix can be built (every combination was skipped)")
            build_modules(configs, root / "modules", jobs=args.jobs, cores=cores, records=result["modules"])
        if args.library:
            result["library"] = build_library(args, arch, root / "library", cores)
            if result["library"]["exit_status"]:
                raise BenchError(f"precompiling the library failed (exit {result['library']['exit_status']}; "
                                 f"failed: {', '.join(result['library']['modules_failed']) or 'see above'})")
        if args.flashinfer:
            result["flashinfer"] = flashinfer_jit(args, arch, root / "flashinfer", cores)
            if "error" in result["flashinfer"]:
                raise BenchError(result["flashinfer"]["error"])
    except (BenchError, VariantgenError, ValueError, OSError) as e:
        error = str(e)
        result["error"] = error
    finally:
        if error is not None:
            result["kept"] = f"{root} kept: the failed build's log and sources are inside"
        elif not args.keep:
            shutil.rmtree(root / "modules", ignore_errors=True)
            shutil.rmtree(root / "library", ignore_errors=True)
            shutil.rmtree(root / "flashinfer", ignore_errors=True)
            if not args.cache_dir:
                shutil.rmtree(root, ignore_errors=True)
    return result, error


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result, error = run(args)
    print(report(result))
    for p in write_json(result, args.out):
        print(f"wrote {p}")
    if error:
        print(f"error: {error}", file=sys.stderr)
        if result.get("kept"):
            print(result["kept"], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
