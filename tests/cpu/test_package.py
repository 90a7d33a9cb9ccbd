"""The wheel: built from the checkout's sources, installed where no checkout is, run from there.

The checkout keeps templates/ and specs/ at its top level; the wheel must carry them inside
the package (variantgen/templates/, variantgen/specs/), and an installed variantgen must
find them there, render the same sources as the checkout (so a module precompiled from
either is the other's too) and accept the shipped specs by name. Offline: the build uses
this environment's setuptools (--no-build-isolation), the install takes no dependencies
(they come from this environment).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from conftest import REPO_DIR, SPEC_FILES, SPECS_DIR, TEMPLATES_DIR
from packaging.version import Version

import variantgen
from variantgen.build import builder as build
from variantgen.build.builder import rendered_sources
from variantgen.codegen.render import ModuleConfig, render_module

# What the wheel is built from (what an sdist or a clean clone has); copied so that the build's
# own folders (build/, *.egg-info) never land in the checkout.
SOURCES = ("pyproject.toml", "README.md", "variantgen", "templates", "specs")
RENDER = ("render", "mm_prefix", "--head-dim", "128", "--dtype", "bf16", "--backend", "fa2", "--file", "all")


def _files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    try:
        setuptools = metadata.version("setuptools")
    except metadata.PackageNotFoundError:
        setuptools = "none"
    assert setuptools != "none" and Version(setuptools) >= Version("70.1"), (
        f"setuptools {setuptools}: the offline wheel build needs setuptools>=70.1 (pip install -e '.[test]')")
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        if (REPO_DIR / name).is_dir():
            shutil.copytree(REPO_DIR / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO_DIR / name, src / name)
    dist = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                           "--no-index", "-w", str(dist)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "warning" not in proc.stderr.lower(), proc.stderr  # e.g. setuptools' "package would be ignored"
    wheels = list(dist.glob("variantgen-*.whl"))
    assert len(wheels) == 1, wheels
    # the metadata's version is variantgen/_version.py's (pyproject.toml reads it)
    assert wheels[0].name.startswith(f"variantgen-{variantgen.__version__}-"), wheels[0].name
    return wheels[0]


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target",
                           str(target), str(wheel)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return target


def _run(installed: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """Run in a folder that is not the checkout, with only the installed copy on the path
    (its dependencies come from this environment's site-packages)."""
    env = dict(os.environ, PYTHONPATH=str(installed), VARIANTGEN_CACHE_DIR=str(tmp_path / "cache"))
    for name in ("VARIANTGEN_TEMPLATE_DIR", "VARIANTGEN_DISABLE_JIT", "FLASHINFER_DISABLE_JIT"):
        env.pop(name, None)
    return subprocess.run(list(args), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


HARNESS = "testing"  # variantgen/testing/: the harness of tests/ and bench/, not shipped


def test_the_wheel_carries_templates_and_specs(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    package = {n for n in names if not n.startswith("variantgen-")}
    expected = ({f"variantgen/templates/{f}" for f in _files(TEMPLATES_DIR)}
                | {f"variantgen/specs/{p.name}" for p in SPEC_FILES}
                | {f"variantgen/{p.relative_to(REPO_DIR / 'variantgen').as_posix()}"
                   for p in (REPO_DIR / "variantgen").rglob("*.py")
                   if "__pycache__" not in p.parts and HARNESS not in p.relative_to(REPO_DIR / "variantgen").parts})
    assert "variantgen/templates/fa3/cutlass_prelude.cuh" in expected  # static sources too, not only .jinja
    assert "variantgen/integrations/transformers.py" in expected  # subpackages too (the docs import it)
    assert "variantgen/testing/harness.py" not in expected  # the tests' harness stays out of the wheel
    assert package == expected, (sorted(expected - package), sorted(package - expected))
    meta = {n.rsplit("/", 1)[-1] for n in names - package}
    assert {"METADATA", "WHEEL", "RECORD", "entry_points.txt"} <= meta
    dist_info = next(n for n in names if n.endswith("entry_points.txt"))
    assert "variantgen = variantgen.tools.cli:main" in zipfile.ZipFile(wheel).read(dist_info).decode()


def test_the_wheel_declares_what_the_package_imports(wheel):
    """numpy (planner.py) and packaging (probing.py) were installed by the project's setup only:
    from the wheel in a fresh environment make_wrapper raised ModuleNotFoundError."""
    names = zipfile.ZipFile(wheel).namelist()
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    requires = {line.split(":", 1)[1].split(";")[0].strip().split(" ")[0].split(">")[0].split("=")[0].split("<")[0]
                for line in meta.splitlines() if line.startswith("Requires-Dist:") and "extra ==" not in line}
    assert {"torch", "numpy", "packaging", "jinja2", "pyyaml", "filelock", "click", "tqdm", "ninja"} <= requires


def test_the_installed_package_uses_its_own_data(installed, tmp_path):
    probe = ("import json, variantgen, variantgen.core.env as e; print(json.dumps([variantgen.__file__, "
             "str(e.TEMPLATES_DIR), str(e.SPECS_DIR), e.IN_CHECKOUT, str(e.settings().cache_dir)]))")
    proc = _run(installed, tmp_path, sys.executable, "-c", probe)
    assert proc.returncode == 0, proc.stderr
    module, templates, specs, in_checkout, cache_dir = json.loads(proc.stdout)
    assert module == str(installed / "variantgen" / "__init__.py")
    assert templates == str(installed / "variantgen" / "templates")
    assert specs == str(installed / "variantgen" / "specs") and in_checkout is False
    assert cache_dir == str(tmp_path / "cache")


def test_the_installed_command_renders_shipped_specs_by_name(installed, tmp_path):
    script = installed / "bin" / "variantgen"
    assert script.is_file()
    proc = _run(installed, tmp_path, str(script), *RENDER)
    assert proc.returncode == 0, proc.stderr
    spec = variantgen.load_spec(SPECS_DIR / "mm_prefix.yaml")
    rendered = render_module(ModuleConfig(spec, 128, 128, "bf16", "bf16", "bf16", "9.0a", "fa2"))
    expected = "".join(f"// ===== {name} =====\n{text}" for name, text in rendered.files.items())
    assert proc.stdout == expected  # the checkout's sources, byte for byte
    proc = _run(installed, tmp_path, str(script), "validate", "mm_prefix", "sliding_window")
    assert proc.returncode == 0 and proc.stdout == "ok  mm_prefix (mm_prefix)\nok  sliding_window (sliding_window)\n"
    proc = _run(installed, tmp_path, str(script), "specs")
    assert proc.returncode == 0 and str(installed / "variantgen" / "specs" / "mm_prefix.yaml") in proc.stdout
    proc = _run(installed, tmp_path, str(script), "validate", "specs/mm_prefix.yaml")
    assert proc.returncode == 1 and "ships a spec named `mm_prefix`: pass that name" in proc.stdout


def test_a_module_key_is_the_same_installed_or_checked_out(installed, tmp_path):
    """Same sources and template digest: a cache precompiled from a checkout serves the wheel."""
    code = ("import variantgen; from variantgen.build import builder as build; "
            "from variantgen.build.builder import rendered_sources; "
            "from variantgen.codegen.render import ModuleConfig; "
            "from variantgen.planning.rowplan import PlannerConfig; s = variantgen.resolve_spec('mm_prefix'); "
            "m = ModuleConfig(s, 128, 128, 'bf16', 'bf16', 'bf16', '9.0a', 'fa3'); "
            "print(build.module_key(rendered_sources(m), None)"
            ".uri); print(build.module_key(PlannerConfig(s, '9.0a').render(), None).uri)")
    proc = _run(installed, tmp_path, sys.executable, "-c", code)
    assert proc.returncode == 0, proc.stderr
    from variantgen.planning.rowplan import PlannerConfig

    spec = variantgen.resolve_spec("mm_prefix")
    module = ModuleConfig(spec, 128, 128, "bf16", "bf16", "bf16", "9.0a", "fa3")
    here = [build.module_key(rendered_sources(module), None).uri,
            build.module_key(PlannerConfig(spec, "9.0a").render(), None).uri]
    assert proc.stdout.split() == here


def test_a_broken_installation_names_its_template_folder(installed, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(installed / "variantgen", broken / "variantgen",
                    ignore=shutil.ignore_patterns("templates", "__pycache__"))
    proc = _run(broken, tmp_path, sys.executable, "-m", "variantgen", *RENDER)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    missing = broken / "variantgen" / "templates"
    assert proc.stderr == (f"error: template folder {missing} (this variantgen installation lacks its templates: "
                           "reinstall the package): expected the subfolders common, fa2, fa3, plan, planner\n")


def test_a_template_dir_setting_that_is_no_template_tree(vg_env, tmp_path):
    (tmp_path / "tpl" / "fa2").mkdir(parents=True)
    vg_env.set(VARIANTGEN_TEMPLATE_DIR=tmp_path / "tpl")
    spec = variantgen.resolve_spec("causal")
    with pytest.raises(variantgen.VariantgenError) as e:
        render_module(ModuleConfig(spec, 128, 128, "bf16", "bf16", "bf16", "9.0a"))
    assert str(e.value) == (f"template folder VARIANTGEN_TEMPLATE_DIR={tmp_path / 'tpl'}: expected the subfolders "
                            "common, fa3, plan, planner")


def test_the_wheel_checks_python_imports_what_the_package_has():
    """scripts/wheel_check.sh (CI, after the tests) feeds Python to the installed wheel: every name
    its snippets import from variantgen exists (a moved module failed CI there once, after the
    whole suite had passed)."""
    import ast
    import importlib.util
    import re

    text = (REPO_DIR / "scripts" / "wheel_check.sh").read_text()
    snippets = re.findall(r"<<'EOF'\n(.*?)\nEOF\n", text, re.S)
    assert len(snippets) >= 2
    checked = 0
    for snippet in snippets:
        for node in ast.walk(ast.parse(snippet)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("variantgen"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), \
                        f"wheel_check.sh: from {node.module} import {alias.name}"
                    checked += 1
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("variantgen"):
                        importlib.import_module(alias.name)
                        checked += 1
    assert checked >= 4
