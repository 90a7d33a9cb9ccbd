#!/usr/bin/env python
"""Long fuzz run of the spec and expression front end (issue 6), outside pytest.

Feeds N generated cases (default 10,000) to ``variantgen.parse_spec`` / ``load_spec`` /
``variantgen.lang.parsing`` + ``expr`` and counts the outcomes. A case may succeed or raise a
``variantgen.core.errors.SpecError`` whose message starts with a location; anything else
(another exception, or an unlocated message) is a bug. Exits 1 if there is any.

Generators (mixed at random): random unicode text, YAML token soup, mutations of the
shipped specs, structured spec-shaped documents with wrong types / missing / duplicate
keys / anchors / tags, expression token soup and grammar-generated expressions, and
binary junk read through load_spec.

    python bench/fuzz_long.py                 # 10,000 cases, seed 0
    python bench/fuzz_long.py -n 50000 --seed 7 --show 5
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "fakes"))

import variantgen  # noqa: E402
from variantgen.codegen import expressions as codegen  # noqa: E402
from variantgen.codegen.render import kernel_args  # noqa: E402
from variantgen.core.errors import MAX_SPEC_ERRORS, SpecError, SpecErrors  # noqa: E402
from variantgen.lang import expr, parsing  # noqa: E402
from variantgen.lang.parsing import SourceText  # noqa: E402

PATH = "fuzz.yaml"
LOCATED = re.compile(rf"^{re.escape(PATH)}(:\d+(:\d+)?)?: \S")
EXPR_LOCATED = re.compile(r"^<string>:\d+:\d+: expression: \S")
SHIPPED = [p.read_text() for p in sorted((REPO / "specs").glob("*.yaml"))]

from fuzz_corpus import ENV, EXPR_TOKENS, HOSTILE_SPECS, NAMES, YAML_TOKENS  # noqa: E402

# ----------------------------------------------------------------------------- generators


def rand_text(r: random.Random, n: int) -> str:
    pools = [(0x20, 0x7E), (0x0, 0x1F), (0x80, 0x2FF), (0x2000, 0x206F), (0xD800, 0xDFFF), (0x1F300, 0x1F5FF),
             (0x660, 0x669), (0xFF00, 0xFFEF)]
    out = []
    for _ in range(n):
        lo, hi = pools[0] if r.random() < 0.7 else r.choice(pools)
        out.append(chr(r.randint(lo, hi)))
    return "".join(out)


def gen_text(r: random.Random) -> str:
    return rand_text(r, r.randint(0, 300))


def gen_yaml_soup(r: random.Random) -> str:
    return "".join(r.choice(YAML_TOKENS) if r.random() < 0.9 else rand_text(r, 3) for _ in range(r.randint(0, 80)))


def gen_expr(r: random.Random, depth: int = 0) -> str:
    if depth > r.randint(2, 9) or r.random() < 0.25:
        choice = r.random()
        if choice < 0.5:
            return r.choice(["kv_pos", "q_pos", "q_idx", "kv_len", "w", "f", "flag", "logits", "nope", "true",
                             "t[q_row, 0]", "s[qo_head]", "t[1]", "w[0]", "t(1)", "min(1)", "t[q_row - w, 1]",
                             "t[kv_row, 0]", "t[q_idx, 0]", "t[2 * q_row, 1]", "s[kv_pos - 1]"])
        if choice < 0.75:
            return str(r.choice([0, 1, -1, 3, 2**31 - 1, 2**31, -(2**31), 10**12, r.randint(-1000, 1000)]))
        return repr(r.choice([0.0, 1.5, -2.25, 1e-45, 3.4e38, 1e39, r.uniform(-100, 100)]))
    kind = r.randrange(7)
    a = gen_expr(r, depth + 1)
    if kind == 0:
        op = r.choice(["+", "-", "*", "/", "//", "%", "<", "<=", "==", "!=", "and", "or", "<", ">="])
        return f"{a} {op} {gen_expr(r, depth + 1)}"
    if kind == 1:
        return f"({a})"
    if kind == 2:
        return f"not {a}"
    if kind == 3:
        return f"-{a}"
    if kind == 4:
        return f"{a} if {gen_expr(r, depth + 1)} else {gen_expr(r, depth + 1)}"
    if kind == 5:
        f = r.choice(["min", "max", "abs", "tanh", "float", "exp", "nope"])
        return f"{f}({', '.join(gen_expr(r, depth + 1) for _ in range(r.randint(0, 3)))})"
    return f"{a} < {gen_expr(r, depth + 1)} < {gen_expr(r, depth + 1)}"


def gen_expr_soup(r: random.Random) -> str:
    sep = r.choice([" ", ""])
    return sep.join(r.choice(EXPR_TOKENS) for _ in range(r.randint(0, 40)))


def gen_pathological_expr(r: random.Random) -> str:
    n = r.randint(1, 2000)
    return r.choice([
        "(" * n + "1" + ")" * n,
        "1 + " * n + "1 > 0",
        "kv_pos < " * n + "1",
        "not " * n + "true",
        "-" * n + "1",
        "min(" * n + "1" + ", 1)" * n,
        "t[" * n + "0, 0]" * n,
        "9" * n,
        "1." + "0" * n + "1",
    ])


def rand_value(r: random.Random):
    return r.choice([None, True, False, 0, 1, -1, 2**31, 10**400, 1.5, float("nan"), float("inf"), "x", "",
                     [1, 2], {"a": 1}, "2022-13-45", rand_text(r, 5)])


GOOD_MASKS = ["kv_pos <= q_pos", "kv_pos <= q_pos and (w < 0 or q_pos - kv_pos <= w)", "t[q_row, 0] <= kv_pos",
              "kv_pos // max(w, 1) == q_pos // max(w, 1)", "flag or s[0] > f", "kv_pos <= max(q_pos, t[q_row, 1])",
              "t[q_row - 1, 0] <= kv_pos", "kv_pos <= t[q_row + w, 1]", "s[kv_pos] > 0.0"]


def gen_range(r: random.Random, dtype: str) -> dict:
    """Random `min` / `max` / `positive` keys (some contradict the default or each other)."""
    out: dict = {}
    if r.random() < 0.3:
        out["min"] = r.randint(-6, 2) if dtype == "int" else r.uniform(-3, 1)
    if r.random() < 0.2:
        out["max"] = r.randint(-1, 8) if dtype == "int" else r.uniform(-1, 3)
    if r.random() < 0.2:
        out["positive"] = r.random() < 0.8
    if r.random() < 0.05:
        out[r.choice(["min", "max", "positive"])] = rand_value(r)
    return out


def gen_hostile(r: random.Random) -> str:
    """A file of HOSTILE_SPECS of tests/fakes/fuzz_corpus.py, sometimes mutated."""
    text = r.choice(list(HOSTILE_SPECS.values()))
    if r.random() < 0.5:
        pos = r.randint(0, len(text))
        text = text[:pos] + (r.choice(YAML_TOKENS) if r.random() < 0.7 else rand_text(r, 5)) + text[pos:]
    return text


def gen_good(r: random.Random) -> str:
    """A mostly valid spec (so that the code after validation runs too), slightly perturbed."""
    doc = {
        "name": r.choice(["x", "good_spec", "a1"]),
        "description": rand_text(r, r.randint(0, 30)),
        # mostly the shapes GOOD_MASKS index correctly (t[q_row, ...], s[0]); sometimes not
        "tensors": {"t": {"dtype": "int32", "shape": [r.choice(["total_q", "total_q", "batch", 4]), 2]},
                    "s": {"dtype": "float32", "shape": [r.choice([3, 3, "num_qo_heads", "total_kv"])]}},
        "scalars": {"w": {"dtype": "int", "default": r.randint(-5, 5), **gen_range(r, "int")},
                    "f": {"dtype": "float", "default": r.uniform(-2, 2), **gen_range(r, "float")},
                    "flag": {"dtype": "bool", "default": r.random() < 0.5}},
        "mask": " and ".join(r.sample(GOOD_MASKS, r.randint(1, 3))) if r.random() < 0.8 else gen_expr(r),
    }
    if r.random() < 0.5:
        doc["logits"] = r.choice(["logits * f", "logits + s[0]", "f * tanh(logits / 2.0)", "logits + " + gen_expr(r)])
    if r.random() < 0.3:
        doc["scales"] = {"sm_scale": r.choice([0.1, 1, "default", None]), "qkv_scales": r.random() < 0.5}
    if r.random() < 0.3:
        key = r.choice(list(doc))
        doc[key] = rand_value(r)
    return yaml.safe_dump(doc, sort_keys=r.random() < 0.5, allow_unicode=True,
                          default_style=r.choice([None, None, None, "'", '"']))


def gen_structured(r: random.Random) -> str:
    doc: dict = {}
    if r.random() < 0.9:
        doc["name"] = r.choice(NAMES) if r.random() < 0.8 else rand_value(r)
    if r.random() < 0.9:
        doc["mask"] = gen_expr(r) if r.random() < 0.85 else rand_value(r)
    if r.random() < 0.4:
        doc["description"] = rand_text(r, r.randint(0, 40)) if r.random() < 0.8 else rand_value(r)
    if r.random() < 0.5:
        doc["tensors"] = {
            r.choice(NAMES): ({"dtype": r.choice(["int32", "float32", "float64", 1]),
                               "shape": [r.choice(["total_q", "total_kv", "batch", "num_qo_heads", "num_kv_heads",
                                                   2, 0, 70000, "total_qq", True]) for _ in range(r.randint(0, 5))]}
                              if r.random() < 0.8 else rand_value(r))
            for _ in range(r.randint(0, 3))
        }
    if r.random() < 0.5:
        doc["scalars"] = {
            r.choice(NAMES): ({"dtype": r.choice(["int", "float", "bool", "int32"]), "default": rand_value(r),
                               **gen_range(r, r.choice(["int", "float"]))}
                              if r.random() < 0.8 else rand_value(r))
            for _ in range(r.randint(0, 3))
        }
    if r.random() < 0.4:
        doc["logits"] = ("logits + " + gen_expr(r)) if r.random() < 0.7 else rand_value(r)
    if r.random() < 0.3:
        doc["scales"] = {r.choice(["sm_scale", "qkv_scales", "other"]): rand_value(r)}
    if r.random() < 0.3:
        doc["backends"] = [r.choice(["fa2", "fa3", "fa4", 2]) for _ in range(r.randint(0, 3))]
    if r.random() < 0.1:
        doc[rand_text(r, 4)] = rand_value(r)
    text = yaml.safe_dump(doc, sort_keys=r.random() < 0.5, allow_unicode=r.random() < 0.5,
                          default_style=r.choice([None, None, "'", '"', "|"]))
    lines = text.splitlines(keepends=True)
    if lines and r.random() < 0.2:  # duplicate key
        text += r.choice(lines)
    if r.random() < 0.2:  # anchors, aliases, tags
        text = text.replace(": ", r.choice([": &a ", ": *a ", ": !!python/object:os.system ", ": !t "]), 1)
    return text


def gen_mutated(r: random.Random) -> str:
    text = r.choice(SHIPPED)
    for _ in range(r.randint(1, 6)):
        op = r.choice(["insert", "delete", "replace", "dup_line", "swap_lines", "truncate", "indent"])
        pos = r.randint(0, len(text))
        if op == "insert":
            text = text[:pos] + (r.choice(YAML_TOKENS) if r.random() < 0.7 else rand_text(r, 5)) + text[pos:]
        elif op == "delete":
            text = text[:pos] + text[pos + r.randint(1, 20):]
        elif op == "replace" and text:
            pos = min(pos, len(text) - 1)
            text = text[:pos] + rand_text(r, 1) + text[pos + 1:]
        elif op in ("dup_line", "swap_lines", "indent"):
            lines = text.splitlines(keepends=True) or [""]
            i, j = r.randrange(len(lines)), r.randrange(len(lines))
            if op == "dup_line":
                lines.insert(j, lines[i])
            elif op == "swap_lines":
                lines[i], lines[j] = lines[j], lines[i]
            else:
                lines[i] = r.choice([" ", "  ", "\t", "- "]) + lines[i]
            text = "".join(lines)
        elif op == "truncate":
            text = text[:pos]
    return text


def gen_binary(r: random.Random) -> bytes:
    if r.random() < 0.5:
        return bytes(r.randrange(256) for _ in range(r.randint(0, 400)))
    text = gen_mutated(r).encode("utf-8", "surrogatepass")
    pos = r.randint(0, len(text))
    return text[:pos] + bytes(r.randrange(128, 256) for _ in range(r.randint(1, 4))) + text[pos:]


# ----------------------------------------------------------------------------- running


def _errors(e: SpecError) -> list[SpecError]:
    return e.errors if isinstance(e, SpecErrors) else [e]


ERROR_CHARS = 1800  # what one error may print at most (tests/cpu/test_fuzz.py)


def check_error_text(e: SpecError, path: str) -> None:
    """Printable (no lone surrogate), at most MAX_SPEC_ERRORS errors, bounded size."""
    text = str(e)
    text.encode("utf-8")
    errors = _errors(e)
    if len(errors) > MAX_SPEC_ERRORS or len(text) > (len(errors) + 1) * (ERROR_CHARS + len(path)):
        raise AssertionError(f"unbounded error output: {len(errors)} errors, {len(text)} characters")


def run_spec(text: str) -> str:
    try:
        spec = variantgen.parse_spec(text, PATH)
    except SpecError as e:
        for one in [e, *_errors(e)]:
            if not LOCATED.match(str(one)):
                raise AssertionError(f"unlocated SpecError message: {str(one)[:200]!r}") from None
        check_error_text(e, PATH)
        return "spec_error"
    codegen.emit_mask(spec)
    codegen.emit_logits(spec)
    kernel_args(spec)
    return "ok"


def run_expr(text: str) -> str:
    src = SourceText(text)
    try:
        tree = parsing.parse(src)
        expr.typecheck(tree, ENV, src, None)
    except SpecError as e:
        if not EXPR_LOCATED.match(str(e)):
            raise AssertionError(f"unlocated SpecError message: {str(e)[:200]!r}") from None
        return "spec_error"
    return "ok"


def run_file(data: bytes, folder: Path) -> str:
    path = folder / "fuzz.yaml"
    path.write_bytes(data)
    try:
        spec = variantgen.load_spec(path)
    except SpecError as e:
        if not str(e).startswith(str(path)):
            raise AssertionError(f"unlocated SpecError message: {str(e)[:200]!r}") from None
        check_error_text(e, str(path))
        return "spec_error"
    codegen.emit_mask(spec)
    return "ok"


GENERATORS = [
    ("text", 1, lambda r, d: run_spec(gen_text(r))),
    ("yaml_soup", 2, lambda r, d: run_spec(gen_yaml_soup(r))),
    ("mutated", 3, lambda r, d: run_spec(gen_mutated(r))),
    ("structured", 3, lambda r, d: run_spec(gen_structured(r))),
    ("good", 2, lambda r, d: run_spec(gen_good(r))),
    ("hostile", 1, lambda r, d: run_spec(gen_hostile(r))),
    ("binary", 1, lambda r, d: run_file(gen_binary(r), d)),
    ("expr", 2, lambda r, d: run_expr(gen_expr(r))),
    ("expr_soup", 2, lambda r, d: run_expr(gen_expr_soup(r))),
    ("expr_deep", 1, lambda r, d: run_expr(gen_pathological_expr(r))),
    ("text_expr", 1, lambda r, d: run_expr(gen_text(r))),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--cases", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", type=int, default=3, help="tracebacks to print for unexpected exceptions")
    args = ap.parse_args(argv)
    master = random.Random(args.seed)
    names = [g[0] for g in GENERATORS]
    weights = [g[1] for g in GENERATORS]
    runners = {g[0]: g[2] for g in GENERATORS}
    outcomes: Counter[tuple[str, str]] = Counter()
    bad: list[tuple[str, int, str]] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vg-fuzz-") as tmp:
        for i in range(args.cases):
            case_seed = master.getrandbits(64)
            gen = master.choices(names, weights)[0]
            try:
                outcomes[(gen, runners[gen](random.Random(case_seed), Path(tmp)))] += 1
            except Exception:  # noqa: BLE001 - counting them is the point
                outcomes[(gen, "UNEXPECTED")] += 1
                bad.append((gen, case_seed, traceback.format_exc()))
            if (i + 1) % 2000 == 0:
                print(f"  {i + 1} cases, {len(bad)} unexpected, {time.perf_counter() - t0:.1f}s", flush=True)
    seconds = time.perf_counter() - t0
    print(f"fuzz_long: {args.cases} cases (seed {args.seed}) in {seconds:.1f}s")
    for gen in names:
        row = {k[1]: v for k, v in outcomes.items() if k[0] == gen}
        print(f"  {gen:11s} ok={row.get('ok', 0):5d} spec_error={row.get('spec_error', 0):5d} "
              f"unexpected={row.get('UNEXPECTED', 0)}")
    print(f"non-SpecError exceptions: {len(bad)}")
    for gen, seed, tb in bad[: args.show]:
        print(f"\n--- {gen} case seed {seed} (reproduce: {gen} generator with random.Random({seed}))\n{tb}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
