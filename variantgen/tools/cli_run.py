"""The ``variantgen`` commands that run or load a spec: check (against the derived reference),
probe (can it run here, per backend and kind) and demo (validate, render, build, run)."""

from __future__ import annotations

import json
import sys
import time

import click

from ..core import env
from ..core.errors import VariantgenError
from ..lang.library import resolve_spec
from ..routing.capabilities import BACKENDS, CLI_NAMES, KINDS, Request
from .cli_options import (
    DEFAULT_ARCH,
    FOLDER,
    Finite,
    arch_option,
    chosen_arch,
    module_config,
    open_cache,
    parse_choices,
)

# ----------------------------------------------------------------------------- probe


@click.command("probe")
@click.argument("spec", type=click.Path())
@click.option("--head-dim", type=int, required=True)
@click.option("--head-dim-vo", type=int, default=None)
@click.option("--dtype", required=True, help="Query dtype.")
@click.option("--kv-dtype", default=None, help="KV dtype (default: --dtype).")
@click.option("--o-dtype", default=None)
@click.option("--backend", "backends", default="auto", show_default=True,
              help="Backend(s): auto (what make_wrapper picks here), fa2, fa3, flex (torch's FlexAttention), or "
                   "a list such as fa2,fa3,flex: one answer per backend and kind.")
@click.option("--kind", "kinds", default="prefill", show_default=True,
              help="Kernel kind(s): prefill, ragged, decode (comma list).")
@click.option("--arch", default=None, callback=arch_option, help="The arch the GPU must have (the probe answers "
              "for this machine: to check a cache for another GPU, use `precompile ... --check`).")
@click.option("--device", default=None, help="CUDA device, e.g. cuda:1 (default: the current one).")
@click.option("--page-size", type=click.IntRange(min=1), default=None)
@click.option("--no-build", is_flag=True, help="Only look in the cache.")
@click.option("--cuda-graph", is_flag=True, help="For CUDA-graph mode (make_wrapper(graph=...)): paged prefill "
              "on fa2 and decode.")
@click.option("--cache-dir", type=FOLDER, default=None)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def probe_cmd(spec: str, head_dim: int, head_dim_vo: int | None, dtype: str, kv_dtype: str | None,
              o_dtype: str | None, backends: str, kinds: str, arch: str | None, device: str | None,
              page_size: int | None, no_build: bool, cuda_graph: bool, cache_dir: str | None,
              as_json: bool) -> None:
    """Say whether SPEC can run here, now, or why not, per backend and kind.

    \b
    Exit status:
      0  every backend and kind asked for runs here: its FlashInfer module was found or built and
         loaded on a visible GPU, or (the flex route) torch's FlexAttention runs it on this
         machine's device, the CPU included. --backend auto answers for what make_wrapper
         would pick here, so on a CPU machine it is the flex route and exits 0.
      1  at least one cannot run here; its `reason:` says why.
      2  a usage error (an option's value)."""
    from ..api.probing import probe_backends

    try:
        parsed = resolve_spec(spec)
    except (VariantgenError, OSError, TypeError):
        parsed = None  # (the probe's answer says why)
    if parsed is not None:
        try:  # the arguments' own errors, named as typed here (the probe's reasons name Python's)
            Request.of(parsed, head_dim_qk=head_dim, head_dim_vo=head_dim_vo, q_dtype=dtype, kv_dtype=kv_dtype,
                       o_dtype=o_dtype, names=CLI_NAMES)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
    results = probe_backends(
        parsed if parsed is not None else spec, kinds=tuple(parse_choices(kinds, list(KINDS), "--kind", ["prefill"])),
        backends=tuple(None if b == "auto" else b for b in parse_choices(backends, (*BACKENDS, "auto"),
                                                                   "--backend", ["auto"])), head_dim_qk=head_dim,
        head_dim_vo=head_dim_vo, q_dtype=dtype, kv_dtype=kv_dtype or dtype, o_dtype=o_dtype, page_size=page_size,
        device=device, build=not no_build, cache_dir=cache_dir, arch=arch, cuda_graph=cuda_graph)
    if as_json:
        payload = [{"backend": r.details.get("backend", b or "auto"), "kind": k, "ok": r.ok, "reason": r.reason,
                    "uri": r.uri, "source": r.source,
                    "module_path": r.module_path, "seconds": round(r.seconds, 3), "details": r.details}
                   for (b, k), r in results.items()]
        click.echo(json.dumps(payload[0] if len(payload) == 1 else payload, indent=1, default=str))
        sys.exit(0 if all(r.ok for r in results.values()) else 1)
    for i, ((b, k), r) in enumerate(results.items()):
        if len(results) > 1:
            click.echo(("\n" if i else "") + f"[{r.details.get('backend', b or 'auto')} {k}]")
        click.echo(f"ok:      {'yes' if r.ok else 'no'}")
        if not r.ok:
            click.echo(f"reason:  {r.reason}")
        click.echo(f"backend: {r.details.get('backend', b or 'auto')}")
        click.echo(f"uri:     {r.uri or '-'}")
        click.echo(f"source:  {r.source}")
        if r.module_path:
            click.echo(f"module:  {r.module_path}")
        if r.details.get("note"):
            click.echo(f"note:    {r.details['note']}")
        click.echo(f"seconds: {r.seconds:.2f}")
    sys.exit(0 if all(r.ok for r in results.values()) else 1)


# ----------------------------------------------------------------------------- check


@click.command()
@click.argument("spec", type=click.Path())
@click.option("--head-dim", type=int, required=True, help="Head dim of q, k and v, e.g. 128.")
@click.option("--dtype", required=True, help="Query dtype: bf16, fp16 (fp32 on the flex route).")
@click.option("--kv-dtype", default=None, help="KV cache dtype (default: --dtype).")
@click.option("--o-dtype", default=None, help="Output dtype (default: --dtype).")
@click.option("--backend", type=click.Choice([*BACKENDS, "auto"]), default="auto", show_default=True,
              help="auto: what make_wrapper picks here (on a CPU machine: flex, torch's FlexAttention).")
@click.option("--batch-size", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--qo-len", type=click.IntRange(min=1), default=128, show_default=True, help="Max queries per request.")
@click.option("--kv-len", type=click.IntRange(min=1), default=512, show_default=True, help="Max keys per request.")
@click.option("--num-qo-heads", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--num-kv-heads", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--page-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--planner/--no-planner", default=False, show_default=True,
              help="Use the interval planner (skip_tiles) in plan().")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--tol", type=Finite(min=0), default=2e-2, show_default=True, help="Largest relative error accepted.")
@click.option("--cache-dir", type=FOLDER, default=None)
def check(spec: str, head_dim: int, dtype: str, kv_dtype: str | None, o_dtype: str | None, backend: str,
          batch_size: int, qo_len: int, kv_len: int, num_qo_heads: int, num_kv_heads: int, page_size: int,
          planner: bool, seed: int, tol: float, cache_dir: str | None) -> None:
    """Run SPEC on a random batch through a backend that runs here and compare it with the
    derived reference: its module on a GPU, the flex route (FlexAttention) on a CPU. Exit 0 when
    it matches, 1 when not."""
    from .check import run_check

    variant = resolve_spec(spec)  # a wrong spec is reported wherever this runs
    result = run_check(variant, head_dim=head_dim, dtype=dtype, kv_dtype=kv_dtype, o_dtype=o_dtype,
                       backend=None if backend == "auto" else backend, batch_size=batch_size, qo_len=qo_len,
                       kv_len=kv_len, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, page_size=page_size,
                       planner=planner, seed=seed, tol=tol, cache=open_cache(cache_dir), echo=click.echo)
    click.echo(result.line(batch_size, num_qo_heads, num_kv_heads))
    sys.exit(0 if result.ok else 1)



@click.command()
@click.argument("spec", type=click.Path())
@click.option("--head-dim", type=int, default=128, show_default=True)
@click.option("--dtype", default="bf16", show_default=True)
@click.option("--arch", default=None, callback=arch_option,
              help=f"Target arch (default: the visible GPU, VARIANTGEN_ARCH, else {DEFAULT_ARCH}).")
@click.pass_context
def demo(ctx: click.Context, spec: str, head_dim: int, dtype: str, arch: str | None) -> None:
    """The main job end to end: validate SPEC, render its CUDA, compile and cache the module
    (nvcc; no GPU needed), then run it against the derived reference if a GPU is present. It
    builds the fa2 module, which runs on every supported GPU (`precompile` builds what
    make_wrapper picks per arch, fa3 on sm90)."""
    from ..build.builder import build_module
    from ..codegen.render import render_module

    variant = resolve_spec(spec)
    click.echo(f"[1/4] {spec}: valid spec `{variant.name}` ({len(variant.tensors)} tensor(s), "
               f"{len(variant.scalars)} scalar(s))")
    cfg = module_config(variant, head_dim, None, dtype, None, None, "fa2", chosen_arch(arch))
    rendered = render_module(cfg)
    body = rendered.files["variant.cuh"]
    start = body.index("struct ")
    click.echo(f"[2/4] rendered {len(rendered.files)} files; the variant:\n" + body[start:start + 1800] + "\n  ...")
    from ..core.progress import BuildProgress, first_build_takes

    click.echo(f"[3/4] compiling the module with nvcc ({len(rendered.compile_units)} compile units; a first build "
               f"takes {first_build_takes('fa2')} on 16 cores, several minutes on 2; the cache serves it after)",
               err=True)
    t0 = time.perf_counter()
    result = build_module(cfg, env.settings() and open_cache(None),
                          progress=lambda uri, units, kind: BuildProgress(uri, units, kind, lines=True))
    status = "built" if result.built else "found in cache"
    click.echo(f"[3/4] module {result.entry.uri} {status} in {time.perf_counter() - t0:.1f}s "
               f"({result.entry.path})")
    import torch

    if not torch.cuda.is_available():
        click.echo("[4/4] no CUDA GPU here: skipped running the kernel (run `variantgen check` on a GPU)")
        return
    click.echo("[4/4] running on the GPU against the derived reference:")
    ctx.invoke(check, spec=spec, head_dim=head_dim, dtype=dtype, planner=True, backend="fa2")  # the module built above
