"""The generated C++ of a spec's expressions, compiled for the host and run over a batch.

codegen.py's output for the mask, the logits transform and the sink is put in a small host
program (the device helpers of templates/common with ``__device__`` defined away, the hook
locals as the kernels define them, the spec's arguments as fields of a struct the way the
kernels' params carry them) and evaluated at every (request, query head, query, key) of a
batch; ``compare`` checks it against the torch evaluator (reference.py's grids), the oracle of
every other test. The fake kernels evaluate masks in torch, so without this a codegen bug (an
index left unclamped) would only show up on a GPU.
"""

from __future__ import annotations

import random
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from variantgen.codegen import expressions as codegen
from variantgen.codegen import render
from variantgen.lang.values import VariantSpec
from variantgen.wrappers.reference import RequestGrid, grid_env, mask_for_request, sink_for_request, transform_logits

CXX = shutil.which("g++") or shutil.which("c++")
HOST = codegen.Target("a.", "int32_t(num_qo_heads)", "int32_t(num_kv_heads)")
C_TYPES = {"int32": "int32_t", "float32": "float"}
SCALAR_TYPES = {"int": "int32_t", "float": "float", "bool": "bool"}

PROGRAM = r"""
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>
#define __device__
#define __forceinline__ inline
{helpers}
struct Args {{
{fields}
}};
int main() {{
  int batch = 0, num_qo_heads = 0, num_kv_heads = 0;
  if (std::scanf("%d %d %d", &batch, &num_qo_heads, &num_kv_heads) != 3) return 2;
  std::vector<int> qo_lens(batch), kv_lens(batch);
  for (int b = 0; b < batch; ++b) if (std::scanf("%d %d", &qo_lens[b], &kv_lens[b]) != 2) return 2;
  Args a;
{read_tensors}
{read_scalars}
  int32_t q_row_base = 0, kv_row_base = 0;
  for (int b = 0; b < batch; ++b) {{
    const uint32_t qo_len = qo_lens[b], kv_len = kv_lens[b];
    const int32_t request = b, req_qo_len = qo_lens[b], req_kv_len = kv_lens[b];
    const int32_t q_pos_base = req_kv_len - req_qo_len, kv_pos_base = 0;
    const auto key_pos = [=](int32_t i) {{ return kv_pos_base + i; }};  // (the variants' member: no gaps here)
    for (int h = 0; h < num_qo_heads; ++h) {{
      const uint32_t qo_head_idx = h, kv_head_idx = h / (num_qo_heads / num_kv_heads);
      for (uint32_t qo_idx = 0; qo_idx < qo_len; ++qo_idx) {{
        for (uint32_t kv_idx = 0; kv_idx < kv_len; ++kv_idx) {{
{locals}
          const float score = float(int((qo_idx * 131 + kv_idx * 71 + h * 29 + b * 13) % 97) - 48) * 0.25f;
          const bool visible = {mask};
          const float logit = {logits};
          const float sink = {sink};
          std::printf("%d %.9g %.9g\n", int(visible), double(logit), double(sink));
        }}
      }}
    }}
    q_row_base += req_qo_len;
    kv_row_base += req_kv_len;
  }}
  return 0;
}}
"""


def source(spec: VariantSpec) -> str:
    """The host program of ``spec``'s generated expressions."""
    mask = codegen.emit_mask(spec, HOST)
    logits = codegen.emit_logits(spec, "score", HOST)
    sink = codegen.emit_sink(spec, HOST)
    builtins = mask.builtins | (logits.builtins if logits else frozenset()) | (sink.builtins if sink else frozenset())
    fields = "\n".join(f"  const {C_TYPES[t.dtype]}* {t.name};" for t in spec.tensors)
    reads = []
    for t in spec.tensors:
        fmt, ctype = ("%d", "int32_t") if t.dtype == "int32" else ("%f", "float")
        reads.append(f"  static std::vector<{ctype}> t_{t.name};\n"
                     f"  {{ long n = 0; if (std::scanf(\"%ld\", &n) != 1) return 2; t_{t.name}.resize(n);\n"
                     f"    for (long i = 0; i < n; ++i) if (std::scanf(\"{fmt}\", &t_{t.name}[i]) != 1) return 2; }}\n"
                     f"  a.{t.name} = t_{t.name}.data();")
    scalars = []
    for s in spec.scalars:
        if s.dtype == "float":
            scalars.append(f"  float arg_{s.name} = 0; if (std::scanf(\"%f\", &arg_{s.name}) != 1) return 2;")
        else:
            scalars.append(f"  int v_{s.name} = 0; if (std::scanf(\"%d\", &v_{s.name}) != 1) return 2;\n"
                           f"  const {SCALAR_TYPES[s.dtype]} arg_{s.name} = {SCALAR_TYPES[s.dtype]}(v_{s.name});")
    # the mask's scalar divisors, set once as the variants' constructors set them
    scalars += [f"  vg::vg_int_divisor {member};\n  {member}.set({value});" for member, value in mask.divisors]
    return PROGRAM.format(
        helpers=render.environment().get_template("common/helpers.cuh.jinja").render(),
        fields=fields or "  int unused;",
        read_tensors="\n".join(reads),
        read_scalars="\n".join(scalars),
        locals=codegen.hook_locals(frozenset(builtins), indent="          ", target=HOST),
        mask=mask.code,
        logits=logits.code if logits else "score",
        sink=sink.code if sink else "0.0f",
    )


def build(spec: VariantSpec, folder: Path) -> Path:
    src = folder / f"{spec.name}.cpp"
    src.write_text(source(spec))
    binary = folder / spec.name
    done = subprocess.run([CXX, "-std=c++17", "-O0", "-o", str(binary), str(src)], capture_output=True, text=True,
                          timeout=120)
    if done.returncode != 0:
        raise AssertionError(f"the generated expressions of {spec.name} do not compile:\n{done.stderr[-3000:]}")
    return binary


@dataclass
class Batch:
    lens: list[tuple[int, int]]  # (qo_len, kv_len) per request
    num_qo_heads: int
    num_kv_heads: int
    args: dict  # spec arguments: tensors and scalars by name

    def dims(self) -> dict[str, int]:
        return {"total_q": sum(q for q, _ in self.lens), "total_kv": sum(k for _, k in self.lens),
                "batch": len(self.lens), "num_qo_heads": self.num_qo_heads, "num_kv_heads": self.num_kv_heads}


def random_batch(spec: VariantSpec, rng: random.Random, lens: list[tuple[int, int]] | None = None,
                 num_qo_heads: int = 4, num_kv_heads: int = 2, defaults: bool = False) -> Batch:
    """Random spec arguments: int tensors of small values (positions, ids, bit words alike),
    float tensors of normal values; scalars random within their range (or their defaults)."""
    lens = lens or [(3, 5), (1, 4), (5, 11), (2, 2)]
    batch = Batch(lens, num_qo_heads, num_kv_heads, {})
    dims = batch.dims()
    for t in spec.tensors:
        shape = [dims[d] if isinstance(d, str) else d for d in t.shape]
        n = 1
        for d in shape:
            n *= d
        if t.dtype == "int32":
            values = [rng.choice([rng.randint(-2, 12), rng.randint(-(2**31) + 64, 2**31 - 64)]) for _ in range(n)]
            batch.args[t.name] = torch.tensor(values, dtype=torch.int32).view(shape)
        else:
            batch.args[t.name] = torch.tensor([rng.gauss(0, 1) for _ in range(n)], dtype=torch.float32).view(shape)
    for s in spec.scalars:
        if defaults:
            continue
        for _ in range(100):
            value = {"int": lambda: rng.randint(-3, 12), "float": lambda: rng.uniform(0.5, 60.0),
                     "bool": lambda: rng.random() < 0.5}[s.dtype]()
            if s.out_of_range(value) is None:
                batch.args[s.name] = float(torch.tensor(value, dtype=torch.float32)) if s.dtype == "float" else value
                break
    return batch


def run(binary: Path, spec: VariantSpec, batch: Batch) -> torch.Tensor:
    """[points, 3] float64: visible, transformed logit, sink at every (request, head, query, key)."""
    words = [f"{len(batch.lens)} {batch.num_qo_heads} {batch.num_kv_heads}"]
    words += [f"{q} {k}" for q, k in batch.lens]
    for t in spec.tensors:
        flat = batch.args[t.name].flatten().tolist()
        words.append(str(len(flat)))
        words += [repr(v) if t.dtype == "float32" else str(v) for v in flat]
    for s in spec.scalars:
        value = batch.args.get(s.name, s.default)
        words.append(repr(float(value)) if s.dtype == "float" else str(int(value)))
    done = subprocess.run([str(binary)], input="\n".join(words) + "\n", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"host program failed ({done.returncode}): {done.stderr[-2000:]}"
    rows = [[float(x) for x in line.split()] for line in done.stdout.splitlines()]
    return torch.tensor(rows, dtype=torch.float64)


def evaluate(spec: VariantSpec, batch: Batch) -> torch.Tensor:
    """The same points from the torch evaluator (reference.py's request grids)."""
    out = []
    q_row = kv_row = 0
    for b, (qo_len, kv_len) in enumerate(batch.lens):
        grid = RequestGrid(b, qo_len, kv_len, q_row, kv_row, batch.num_qo_heads, batch.num_kv_heads,
                           torch.device("cpu"))
        env = grid_env(grid)
        h, i, j = env["qo_head"], env["q_idx"], env["kv_pos"]
        scores = (((i * 131 + j * 71 + h * 29 + b * 13) % 97) - 48).to(torch.float32) * 0.25
        scores = scores.expand(batch.num_qo_heads, qo_len, kv_len).contiguous()
        mask = mask_for_request(spec, grid, batch.args).to(torch.float64)
        logits = transform_logits(spec, grid, batch.args, scores).to(torch.float64)
        sink = sink_for_request(spec, grid, batch.args)
        sink = (torch.zeros(batch.num_qo_heads, 1) if sink is None else sink).to(torch.float64)
        sink = sink.view(-1, 1, 1).expand(batch.num_qo_heads, qo_len, kv_len)
        out.append(torch.stack([mask.expand_as(logits), logits, sink], dim=-1).reshape(-1, 3))
        q_row += qo_len
        kv_row += kv_len
    return torch.cat(out)


def mismatches(spec: VariantSpec, binary: Path, batch: Batch) -> list[str]:
    """Where the compiled expressions and the evaluator disagree (masks exactly; logits and sink
    within float32 rounding of the host's libm against torch's)."""
    got, want = run(binary, spec, batch), evaluate(spec, batch)
    assert got.shape == want.shape, (got.shape, want.shape)
    bad = []
    close = torch.isclose(got[:, 1:], want[:, 1:], rtol=2e-6, atol=2e-6, equal_nan=True).all(dim=1)
    for n in torch.nonzero((got[:, 0] != want[:, 0]) | ~close).flatten().tolist()[:10]:
        bad.append(f"point {n}: c++ {got[n].tolist()} vs evaluator {want[n].tolist()}")
    return bad
