"""The ``variantgen`` commands that look without running a kernel: validate, specs, render,
explain and doctor."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from ..core import env
from ..core.errors import SpecError, printable
from ..lang.library import resolve_spec, shipped_specs
from ..lang.values import VariantSpec
from ..routing.capabilities import KINDS, MODULE_BACKENDS
from .cli_options import DEFAULT_ARCH, FOLDER, arch_option, chosen_arch, module_config, parse_choices, table
from .explain import ARG_FORMS

# ----------------------------------------------------------------------------- validate


@click.command()
@click.argument("specs", nargs=-1, required=True, type=click.Path())
def validate(specs: tuple[str, ...]) -> None:
    """Check spec files (or shipped specs by name); print every error with its file:line:col."""
    failed = 0
    for path in specs:
        try:
            spec = resolve_spec(path)
        except SpecError as e:  # one or several (SpecErrors), each line naming the file
            failed += 1
            click.echo(str(e))
            continue
        click.echo(f"ok  {printable(path)} ({spec.name})")
        _planner_notes(spec)
    if failed:
        click.echo(f"{failed} of {len(specs)} spec file(s) have errors", err=True)
        sys.exit(1)


def _planner_notes(spec: VariantSpec) -> None:
    """Where the interval planner cannot bound the mask: a note at the mask's line saying what it
    needs and, where one exists, an equivalent form it plans (planner_notes.py)."""
    from ..planning.notes import planner_notes

    where = spec.locations.get("mask") or spec.path
    for note in planner_notes(spec):
        click.echo(f"{where}: note: {note.message}" + (f"\n  hint: {note.hint}" if note.hint else ""))


@click.command("specs")
def specs_cmd() -> None:
    """Table of the specs shipped with variantgen: pass a name wherever a spec file is accepted."""
    rows = []
    for name, path in shipped_specs().items():
        spec = resolve_spec(path)
        rows.append([name, " ".join(spec.description.split()), str(path)])
    click.echo(table(["name", "description", "file"], rows))


# ----------------------------------------------------------------------------- render


@click.command()
@click.argument("spec", type=click.Path())
@click.option("--head-dim", type=int, required=True, help="Head dim of q/k (and v unless --head-dim-vo).")
@click.option("--head-dim-vo", type=int, default=None)
@click.option("--dtype", required=True, help="Query dtype: bf16, fp16.")
@click.option("--kv-dtype", default=None, help="KV cache dtype (default: --dtype).")
@click.option("--o-dtype", default=None, help="Output dtype (default: --dtype).")
@click.option("--backend", type=click.Choice([*MODULE_BACKENDS, "auto"]), default="auto", show_default=True,
              help="auto: what make_wrapper picks on a GPU of --arch.")
@click.option("--kind", type=click.Choice(list(KINDS)), default="prefill", show_default=True,
              help="Kernel kind.")
@click.option("--arch", default=None, callback=arch_option,
              help=f"Target arch (default: the visible GPU, VARIANTGEN_ARCH, else {DEFAULT_ARCH}).")
@click.option("-o", "--output-dir", type=FOLDER, default=None,
              help="Write the rendered files here instead of printing.")
@click.option("--file", "file_name", default=None,
              help="File to print (default variant.cuh), or 'all'.")
def render(spec: str, head_dim: int, head_dim_vo: int | None, dtype: str, kv_dtype: str | None,
           o_dtype: str | None, backend: str, kind: str, arch: str | None, output_dir: str | None,
           file_name: str | None) -> None:
    """Print the generated variant.cuh (or write every generated file to -o DIR) of the module
    make_wrapper would build (--backend auto) or of the backend named."""
    from ..codegen.render import render_module

    config = module_config(spec, head_dim, head_dim_vo, dtype, kv_dtype, o_dtype, backend,
                            chosen_arch(arch), kind)
    rendered = render_module(config)
    if file_name not in (None, "all") and file_name not in rendered.files:
        raise click.BadParameter(f"{file_name!r}: expected 'all' or one of {', '.join(rendered.files)}",
                                 param_hint="--file")
    if output_dir:
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        names = list(rendered.files) if file_name in (None, "all") else [file_name]
        for name in names:
            (out / name).write_text(rendered.files[name])
            click.echo(str(out / name))
        return
    if file_name == "all":
        for name, text in rendered.files.items():
            click.echo(f"// ===== {name} =====")
            click.echo(text, nl=not text.endswith("\n"))
        return
    text = rendered.files[file_name or "variant.cuh"]
    click.echo(text, nl=not text.endswith("\n"))


# ----------------------------------------------------------------------------- explain


@click.command(epilog="\b\nSpec arguments: " + ARG_FORMS)
@click.argument("spec", type=click.Path())
@click.option("--qo", "qo_len", type=int, default=8, show_default=True, help="Queries of the request.")
@click.option("--kv", "kv_len", type=int, default=None, help="Keys of the request, cached ones included "
              "(default: --qo); the queries are the last --qo of them.")
@click.option("--arg", "arg_items", multiple=True, metavar="NAME=VALUE", help="A spec argument (repeatable; "
              "forms below).")
@click.option("--page-size", type=int, default=16, show_default=True, help="KV page size the planner aligns to.")
@click.option("--heads", type=int, default=1, show_default=True, help="Query heads (num_qo_heads).")
@click.option("--head", type=int, default=0, show_default=True, help="The query head whose mask is shown.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random tensors not given.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON: keys_read, keys_visible (per launch class too), "
              "the terms and launch requests, and the grid for small requests.")
def explain(spec: str, qo_len: int, kv_len: int | None, arg_items: tuple[str, ...], page_size: int, heads: int,
            head: int, seed: int, as_json: bool) -> None:
    """Show SPEC's mask for one request as a grid (queries x keys), the key intervals the planner
    derives per row, which rows run dense / causal / window / custom, and the cost: keys the
    launches read against keys the mask shows - on the CPU. Requests of up to 65536 tokens; the
    grid is drawn up to 256."""
    from . import explain as ex

    variant = resolve_spec(spec)
    kv = qo_len if kv_len is None else kv_len
    ex.check_request(qo_len, kv, page_size=page_size, heads=heads, head=head)
    args = ex.resolve_args(variant, arg_items, qo_len, kv, heads, seed)
    e = ex.explain(variant, qo_len, kv, args, page_size=page_size, head=head, heads=heads)
    click.echo(json.dumps(ex.to_json(e), indent=1) if as_json else ex.render(e))


# ----------------------------------------------------------------------------- doctor


@click.command()
@click.option("--need", "needs", default=None,
              help="What this machine is for, comma list of build, run, gpu, flex: exit 0 only if it can do all of "
                   "it. run: a spec runs here on either route (FlashInfer modules on a GPU, or the flex route, "
                   "FlexAttention, on any device); gpu: FlashInfer modules run here; flex: the flex route runs "
                   "here. Default: run, and build too where a GPU runs modules and JIT is on. A build box: "
                   "--need build; a GPU server: --need gpu.")
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON.")
def doctor(needs: str | None, as_json: bool) -> None:
    """Check that this machine can build modules (FlashInfer, nvcc, host compilers, ninja, CUDA
    and FlashInfer headers, a writable cache) and run specs (FlashInfer modules on a GPU, the flex
    route anywhere); each line says ok / missing and the fix. Builds nothing. Takes 10-20 s: it
    runs nvcc and the compilers and renders a module to find the headers it includes."""
    from . import doctor as doc

    if needs is not None:
        parse_choices(needs, doc.NEEDS, "--need", [])  # a usage error before the slow checks
    click.echo("checking the toolchain, FlashInfer's headers, the cache and the GPU (10-20 s)...", err=True)
    report = doc.run_checks()
    default = [doc.RUN] + ([doc.BUILD] if report.can(doc.GPU) and not env.settings().jit_disabled else [])
    wanted = tuple(parse_choices(needs, doc.NEEDS, "--need", default))
    ok = all(report.can(what) for what in wanted)
    if as_json:
        click.echo(json.dumps({"checks": [dict(name=c.name, status=c.status, detail=c.detail, fix=c.fix,
                                               needed_for=list(c.needed_for)) for c in report.checks],
                               "can_build": report.can(doc.BUILD), "can_run": report.can(doc.RUN),
                               "can_run_modules": report.can(doc.GPU), "can_run_flex": report.can(doc.FLEX),
                               "needed": list(wanted), "ok": ok}, indent=1))
    else:
        click.echo(doc.render(report, wanted))
    sys.exit(0 if ok else 1)
