"""Documentation that runs: every Python and shell example of README.md and docs/*.md runs here,
on the CPU (the flex route where it runs a spec), so an example cannot drift from the code.

The blocks of one page run in order, in one scratch folder (a `specs` link to the shipped specs,
`.venv/bin/variantgen` and `.venv/bin/python` standing for the installed ones). A YAML block
whose first line is `# NAME.yaml` is written there as that file before any block runs (and must
be a valid spec), so the page's commands can use it. An HTML comment on the line before a block says how it runs:

    <!-- example: gpu -->        needs a CUDA GPU: not run on the CPU (the GPU tests cover it)
    <!-- example: build-box -->  precompiles modules with nvcc (minutes): not run here
    <!-- example: setup -->      installs the project (.ci/run runs it, and the wheel check)
    <!-- example: batch -->      Python that uses a small batch on the CPU, defined before it runs:
                                 qo_indptr, kv_indptr, kv_indices, last_page_len, q, k_cache,
                                 v_cache, num_qo_heads (32), num_kv_heads (8), page_size (16),
                                 head dim 128, bf16, and the shipped specs' tensors prefix_len,
                                 ranges, doc_ids

Any other Python or shell block runs as it is and must exit 0.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import variantgen

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUNNABLE = {"python", "bash", "sh", "shell", "console"}
KINDS = {"gpu", "build-box", "setup", "batch"}
FENCE = re.compile(r"^```(\S*)\s*$")
MARKER = re.compile(r"^<!--\s*example:\s*([\w-]+)\s*-->\s*$")
FILE_LINE = re.compile(r"^#\s*([\w.-]+\.ya?ml)\s*$")
# a fence without a language that holds one of these is an example in disguise
COMMAND = re.compile(r"^\s*(variantgen |\.venv/|pip |python |import |from \w+ import )")

BATCH = """
import torch, variantgen
from variantgen.testing.harness import random_paged_batch, random_spec_args
num_qo_heads, num_kv_heads, page_size = 32, 8, 16
_b = random_paged_batch([5, 9], [12, 20], num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=128,
                        page_size=page_size, dtype=torch.bfloat16)
qo_indptr, kv_indptr, kv_indices, last_page_len = _b.plan_args()[:4]
indptrs = (qo_indptr, kv_indptr, kv_indices, last_page_len)
q, k_cache, v_cache = _b.q, _b.k_cache, _b.v_cache
_args = {}
for _name in ("prefix_lm", "mm_prefix", "document"):
    _args.update(random_spec_args(variantgen.resolve_spec(_name), _b))
prefix_len, ranges, doc_ids = _args["prefix_len"], _args["ranges"], _args["doc_ids"]
"""


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    kind: str  # the marker's kind, or "" for none
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        marker = MARKER.match(lines[i - 1]) if i else None
        out.append(Block(page, i + 1, m.group(1), marker.group(1) if marker else "", "\n".join(lines[i + 1:j]) + "\n"))
        i = j + 1
    return out


ALL = [b for page in PAGES for b in blocks(page)]


def test_every_marker_is_known_and_examples_are_labelled():
    for b in ALL:
        assert not b.kind or b.kind in KINDS, f"{b.where}: unknown example marker {b.kind!r}"
        assert not b.kind or b.lang in RUNNABLE, f"{b.where}: a marker on a {b.lang or 'plain'} block"
        if not b.lang:
            commands = [line for line in b.text.splitlines() if COMMAND.match(line)]
            assert not commands, f"{b.where}: a fence without a language holds commands: label it bash or python"
    assert sum(b.lang in RUNNABLE and b.kind not in ("gpu", "build-box", "setup") for b in ALL) >= 5


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_relative_link_exists(page):
    """The Speed table's JSON files and the pages' cross-references."""
    targets = [t for t in LINK.findall(page.read_text()) if "://" not in t]
    missing = [t for t in targets if not (page.parent / t).exists()]
    assert not missing, f"{page.relative_to(REPO)}: links to missing files {missing}"


def _scratch(tmp_path: Path) -> dict[str, str]:
    """The scratch folder and the environment the examples run in."""
    (tmp_path / "specs").symlink_to(REPO / "specs")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "variantgen").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m variantgen.tools.cli "$@"\n')
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VARIANTGEN_") and k != "FLASHINFER_DISABLE_JIT"}
    env.update(CUDA_VISIBLE_DEVICES="", VARIANTGEN_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
               PATH=os.pathsep.join([str(bin_dir), env.get("PATH", "")]))
    return env


def _run(block: Block, cwd: Path, env: dict[str, str]) -> None:
    if block.lang == "python":
        script = cwd / f"example_{block.line}.py"
        script.write_text((BATCH if block.kind == "batch" else "") + block.text)
        command = [sys.executable, str(script)]
    else:
        command = ["bash", "-euo", "pipefail", "-c", block.text]
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{block.where}: exit {proc.returncode}\n{block.text}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, f"{block.where}:\n{proc.stderr}"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_the_examples_of_a_page_run(page, tmp_path):
    env = _scratch(tmp_path)
    for block in blocks(page):  # the page's spec files first: a command may come before the file it uses
        named = FILE_LINE.match(block.text.splitlines()[0]) if block.lang in ("yaml", "yml") and block.text.strip() \
            else None
        if named:
            (tmp_path / named.group(1)).write_text(block.text)
            variantgen.load_spec(tmp_path / named.group(1))  # a valid spec, or SpecError naming its line
    ran = 0
    for block in blocks(page):
        if block.lang not in RUNNABLE or block.kind in ("gpu", "build-box", "setup"):
            continue
        _run(block, tmp_path, env)
        ran += 1
    runnable = [b for b in blocks(page) if b.lang in RUNNABLE]
    assert ran or all(b.kind for b in runnable), page
