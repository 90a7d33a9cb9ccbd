"""The module templates (templates/fa2, fa3, common) checked against what render.py renders them
with (variantgen/codegen/context.py): every variable a template reads is a field of the module's
RenderContext or of the unit dataclass context.UNIT_CONTEXTS names for it (a template rendered
from a context of its own, context.STANDALONE, against that alone), and every field is read by a
template, or is marked as render.py's own (context.PYTHON_ONLY). The planner's template
(templates/planner) has its own context (planning/rowplan.py) and is not checked here.

jinja2.meta.find_undeclared_variables leaves out what a template sets itself (set, for, macro
names and arguments, import aliases); a template imported "with context" (fa2/macros.jinja) is
checked as a template of its own."""

from __future__ import annotations

import dataclasses
import functools

import jinja2
import jinja2.meta
import pytest
from conftest import SPECS_DIR

import variantgen
from variantgen.codegen import context, render
from variantgen.codegen.render import ModuleConfig

MODULE_DIRS = ("common", "fa2", "fa3")


@pytest.fixture(autouse=True)
def _clean_env(vg_env):
    """The checkout's templates and a private cache dir."""


def field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


@functools.cache
def module_templates() -> tuple[str, ...]:
    root = render.template_root()
    return tuple(sorted(p.relative_to(root).as_posix() for d in MODULE_DIRS for p in (root / d).glob("*.jinja")))


def read_variables(name: str) -> set[str]:
    """The variables template ``name`` reads from its context (not Jinja's globals)."""
    env = render.environment()
    source = env.loader.get_source(env, name)[0]
    return jinja2.meta.find_undeclared_variables(env.parse(source)) - set(env.globals)


def test_the_templates_are_found():
    names = module_templates()
    assert {"fa2/variant.cuh.jinja", "fa2/macros.jinja", "fa3/variant.cuh.jinja", "common/meta.inc.jinja"} <= set(names)
    assert set(context.UNIT_CONTEXTS) | set(context.STANDALONE) <= set(names)
    assert not set(context.UNIT_CONTEXTS) & set(context.STANDALONE)


@pytest.mark.parametrize("name", module_templates())
def test_every_variable_a_template_reads_is_a_field(name):
    if name in context.STANDALONE:
        allowed = field_names(context.STANDALONE[name])
    else:
        allowed = field_names(context.RenderContext)
        if name in context.UNIT_CONTEXTS:
            allowed |= field_names(context.UNIT_CONTEXTS[name])
    unknown = read_variables(name) - allowed
    assert not unknown, f"{name} reads {sorted(unknown)}: no field of what render.py renders it with"


def test_every_module_field_is_read_by_a_template_or_by_render():
    read = set().union(*(read_variables(n) for n in module_templates() if n not in context.STANDALONE))
    python_only = {f.name: f.metadata[context.PYTHON_ONLY] for f in dataclasses.fields(context.RenderContext)
                   if context.PYTHON_ONLY in f.metadata}
    dead = field_names(context.RenderContext) - read - set(python_only)
    assert not dead, f"RenderContext fields no template reads: {sorted(dead)}"
    # a field marked as render.py's own is read by no template, and what it names is render.py's
    assert not set(python_only) & read
    for users in python_only.values():
        for user in users.split(", "):
            assert callable(getattr(render, user)), user


@pytest.mark.parametrize("name", sorted({**context.UNIT_CONTEXTS, **context.STANDALONE}))
def test_unit_and_standalone_fields_are_read(name):
    """A unit's variables are read by every template rendered with them; a standalone template
    reads exactly its own context."""
    cls = {**context.UNIT_CONTEXTS, **context.STANDALONE}[name]
    if name in context.STANDALONE:
        assert read_variables(name) == field_names(cls)
    else:
        assert field_names(cls) <= read_variables(name)
        assert not field_names(cls) & field_names(context.RenderContext)  # a unit's variable shadows nothing


def shipped(name: str):
    return variantgen.load_spec(SPECS_DIR / f"{name}.yaml")


def module_config(spec, **kw) -> ModuleConfig:
    base = dict(head_dim_qk=128, head_dim_vo=128, q_dtype="bf16", kv_dtype="bf16", o_dtype="bf16", arch="9.0a")
    return ModuleConfig(spec, **{**base, **kw})


def test_the_context_is_frozen_and_shallow():
    ctx = render.render_context(module_config(shipped("softcap")))
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.struct_name = "x"  # type: ignore[misc]
    variables = ctx.variables()
    assert variables["spec"] is ctx.spec and variables["tensor_params"] is ctx.tensor_params
    assert variables["struct_name"] == ctx.struct_name == render.struct_name(ctx.spec)


def test_kind_fields_are_absent_where_they_do_not_apply():
    """The backend / kind fields are None in the shared context, and then no variable, so that a
    template reading one where it does not apply fails (StrictUndefined), as a missing key did."""
    optional = {f.name for f in dataclasses.fields(context.RenderContext)
                if f.default is None and f.default_factory is dataclasses.MISSING}
    assert optional == {"kernel_modes", "cta_tiles", "all_cta_tiles", "cutlass_q", "cutlass_kv", "cutlass_o",
                        "plain_shared"}
    ctx = render.render_context(module_config(shipped("causal"), kind="decode"))
    assert not optional & set(ctx.variables())
    env = render.environment()
    with pytest.raises(jinja2.UndefinedError, match="kernel_modes"):
        render.render_template(env, "fa2/config.inc.jinja", ctx)  # the prefill config, without its kernel modes
    with pytest.raises(jinja2.UndefinedError, match="cutlass_q"):
        render.render_template(env, "fa3/config.inc.jinja", ctx)


def test_render_template_takes_the_unit_its_template_names():
    ctx = render.render_context(module_config(shipped("causal")))
    env = render.environment()
    modes = render.fa2_kernel_modes(ctx, tail=True)
    ctx = dataclasses.replace(ctx, kernel_modes=modes)
    text = render.render_template(env, "fa2/paged_kernel.cu.jinja", ctx, context.Fa2KernelUnit(modes, 64, None))
    assert "CTA_TILE_Q=64" in text
    with pytest.raises(TypeError, match="expected Fa2KernelUnit"):
        render.render_template(env, "fa2/paged_kernel.cu.jinja", ctx)
    with pytest.raises(TypeError, match="expected NoneType"):
        render.render_template(env, "fa2/variant.cuh.jinja", ctx, context.Fa2KernelUnit(modes, 64, None))
    with pytest.raises(TypeError, match="expected Fa3Binding"):
        render.render_template(env, "fa3/binding.cu.jinja", ctx, context.Fa3KernelUnit({}))
    with pytest.raises(TypeError, match="expected Fa3PlainKernel"):
        render.render_template(env, "fa3/plain_kernel.cu.jinja", ctx)
