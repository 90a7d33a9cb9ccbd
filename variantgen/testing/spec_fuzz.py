"""A fuzzer of the spec loader: hostile spec files, and what the loader made of each.

``cases(seed, n)`` generates spec texts of these kinds: huge numbers, lone surrogates (escaped
and raw), deep nesting (YAML and expressions), YAML anchors / aliases / tags / directives,
files with many errors, the values YAML 1.1 reads otherwise (010, 1:30, yes, 1_000 ...),
reserved argument names, size bombs (long flow lists, duplicate keys) and random mutations of
a valid spec. ``run`` feeds each to ``parse_spec`` and counts the outcomes:

* ``refused``: a SpecError whose text starts with the file's name (a located refusal);
* ``accepted``: a VariantSpec;
* ``unlocated``: a SpecError that does not name the file (must be 0);
* ``other``: any other exception (must be 0);
* ``hangs``: a case that ran past the bound of CPU time (must be 0; stopped by SIGPROF). CPU
  time, not wall time: on a loaded machine a case may wait for a core many times longer than
  it computes.

The tests run a few hundred cases (tests/cpu/test_loader_fuzz.py); bench/loader_fuzz.py runs
thousands and writes the counts as JSON.
"""

from __future__ import annotations

import random
import signal
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field

from ..core.errors import SpecError
from ..lang.reserved import CLASSES
from ..lang.spec import CPP_KEYWORDS, parse_spec

PATH = "fuzz.yaml"
VALID = ("name: fz\ndescription: a valid spec the mutations start from\n"
         "tensors:\n  r: {dtype: int32, shape: [total_q, 2], doc: rows}\n"
         "scalars:\n  w: {dtype: int, default: 4, min: 0}\n  f: {dtype: float, default: 1.5}\n"
         "mask: kv_pos <= q_pos and (w <= 0 or q_pos - kv_pos < w) or r[q_row, 0] <= kv_pos\n"
         "logits: logits * f\n")
YAML11_FORMS = ("010", "-010", "09", "0o17", "0b101", "1:30", "-1:30:00", "1_000", "1_0.5", "0x_ff", "yes", "No",
                "ON", "off", "2024-01-31", "2024-1-1 10:00:00")
HUGE_NUMBERS = ("9" * 5000, "-" + "9" * 400, "1e999", "-1.0e+999", ".inf", "-.inf", ".nan", "0x" + "f" * 3000,
                "1" + "0" * 70 + ".5", "3.5e+38", "2147483648", "-2147483649", "1.0e-46")
SURROGATES = ('"\\ud800"', '"\\udfff x"', '"a\\ud83d"', "\ud800", "x\udc80y")
FIELDS = ("scalars:\n  w: {{dtype: int, default: {v}}}\n", "scalars:\n  w: {{dtype: float, default: 1.0, max: {v}}}\n",
          "tensors:\n  t: {{dtype: int32, shape: [total_q, {v}]}}\n", "scales: {{sm_scale: {v}}}\n",
          "backends: [{v}]\n", "description: {v}\n", "name: {v}\n", "scalars:\n  w: {{dtype: bool, default: {v}}}\n",
          "scalars:\n  w: {{dtype: int, default: 1, positive: {v}}}\n")
CAUSAL = "name: x\nmask: kv_pos <= q_pos\n"


def _reserved_names() -> list[str]:
    names = sorted(set().union(*(c.names for c in CLASSES)) | CPP_KEYWORDS)
    return names + ["a__b", "x__", "__cplusplus", "_x"]


def _huge(rng: random.Random) -> str:
    return CAUSAL + rng.choice(FIELDS).format(v=rng.choice(HUGE_NUMBERS))


def _yaml11(rng: random.Random) -> str:
    return CAUSAL + rng.choice(FIELDS).format(v=rng.choice(YAML11_FORMS))


def _surrogate(rng: random.Random) -> str:
    s = rng.choice(SURROGATES)
    return rng.choice([f"name: x\nmask: {s}\n", f"name: x\nmask: kv_pos <= q_pos\ndescription: {s}\n",
                       f"name: x\nmask: kv_pos <= q_pos\nscalars:\n  {s}: {{dtype: int, default: 1}}\n",
                       f"name: {s}\nmask: kv_pos <= q_pos\n",
                       f"name: x\nmask: kv_pos <= q_pos\ntensors:\n  t: {{dtype: int32, shape: [batch], doc: {s}}}\n"])


def _deep(rng: random.Random) -> str:
    n = rng.choice([20, 33, 64, 200, 5000, 60000])
    return rng.choice([
        CAUSAL + "backends: " + "[" * n + "]" * n + "\n",
        CAUSAL + "description:\n" + "".join(" " * i + "a:\n" for i in range(1, min(n, 400))),
        CAUSAL + "description: " + "- " * n + "\n",
        "name: x\nmask: " + "(" * n + "kv_pos <= q_pos" + ")" * n + "\n",
        "name: x\nmask: kv_pos <= q_pos" + " and kv_pos <= q_pos" * min(n, 20000) + "\n",
        "name: x\nmask: " + "not " * n + "kv_pos <= q_pos\n",
        CAUSAL + "description: " + "{a: " * n + "1" + "}" * n + "\n",
    ])


def _yaml_features(rng: random.Random) -> str:
    return rng.choice([
        "name: &a x\nmask: kv_pos <= q_pos\ndescription: *a\n",
        "base: &b {dtype: int, default: 1}\nname: x\nmask: kv_pos <= q_pos\nscalars:\n  w: *b\n",
        "name: x\nmask: kv_pos <= q_pos\nscalars:\n  w: {<<: *b, dtype: int}\n",
        "name: !!python/object:os.system x\nmask: kv_pos <= q_pos\n",
        "name: !custom x\nmask: kv_pos <= q_pos\n",
        "name: x\nmask: !!str kv_pos <= q_pos\n",
        "%YAML 1.1\n---\nname: x\nmask: kv_pos <= q_pos\n",
        "%TAG !e! tag:example.com,2000:\n---\nname: !e!x x\nmask: kv_pos <= q_pos\n",
        "name: x\nmask: kv_pos <= q_pos\n---\nname: y\nmask: kv_pos <= q_pos\n",
        "? [a, b]\n: 1\nname: x\nmask: kv_pos <= q_pos\n",
        "name: x\nmask: kv_pos <= q_pos\nscalars: !!set {a, b}\n",
        "name: x\nmask: kv_pos <= q_pos\n" + "a: &x" + " [*x]" + "\n",
        "a: &a [" + ", ".join(["*a"] * 50) + "]\n",
    ])


def _many_errors(rng: random.Random) -> str:
    n = rng.choice([5, 25, 300, 3000])
    parts = ["name: Bad Name\nmask: kv_poss <= q_pos or bogus(kv_pos) and q_poss\n"]
    parts.append("scalars:\n" + "".join(f"  s{i}: {{dtype: int, default: {rng.choice(['1.5', '010', 'x'])}}}\n"
                                        for i in range(min(n, 4000))))
    parts.append("".join(f"k{i}: 1\n" for i in range(min(n, 3000))))
    return "".join(parts)


def _reserved(rng: random.Random) -> str:
    names = rng.sample(_reserved_names(), 5)
    section = rng.choice(["tensors", "scalars"])
    decl = "{dtype: int32, shape: [batch]}" if section == "tensors" else "{dtype: int, default: 0}"
    return CAUSAL + f"{section}:\n" + "".join(f"  '{n}': {decl}\n" for n in names)


def _bomb(rng: random.Random) -> str:
    return rng.choice([
        CAUSAL + "backends: [" + ",".join(["1"] * 120_000) + "]\n",
        CAUSAL + "description:\n" + "  a: 1\n" * 40_000,
        CAUSAL + "description: '" + "x" * 250_000 + "'\n",
        CAUSAL + "x" * 300_000,
    ])


def _mutation(rng: random.Random) -> str:
    text = list(VALID)
    for _ in range(rng.randint(1, 8)):
        i = rng.randrange(len(text))
        op = rng.random()
        if op < 0.4:
            text[i] = rng.choice(":{}[],&*!|>'\"%@`#-?\n\t 0123456789abcxyz_\\\x00\x1b\u2028\ufeff")
        elif op < 0.7:
            del text[i]
        else:
            text.insert(i, text[rng.randrange(len(text))])
    return "".join(text)


# (kind, generator, weight): bombs are slow to build and to refuse, so rare
KINDS = (("huge numbers", _huge, 10), ("yaml 1.1 forms", _yaml11, 10), ("surrogates", _surrogate, 8),
         ("deep nesting", _deep, 8), ("yaml anchors/aliases/tags", _yaml_features, 8), ("many errors", _many_errors, 4),
         ("reserved names", _reserved, 8), ("size bombs", _bomb, 1), ("mutations", _mutation, 20))


def cases(seed: int, n: int):
    """``n`` (kind, text) pairs, reproducibly from ``seed``."""
    rng = random.Random(seed)
    kinds = [k for k in KINDS for _ in range(k[2])]
    for _ in range(n):
        kind, make, _ = rng.choice(kinds)
        yield kind, make(rng)


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang()


@dataclass
class Counts:
    refused: int = 0
    accepted: int = 0
    unlocated: int = 0
    other: int = 0
    hangs: int = 0
    by_kind: dict = field(default_factory=dict)
    slowest_s: float = 0.0
    slowest_kind: str = ""
    examples: list = field(default_factory=list)  # the first few failures, for the report

    def as_dict(self) -> dict:
        return {"refused_located": self.refused, "accepted": self.accepted, "refused_unlocated": self.unlocated,
                "other_exceptions": self.other, "hangs": self.hangs, "slowest_case_cpu_s": round(self.slowest_s, 3),
                "slowest_kind": self.slowest_kind, "by_kind": self.by_kind, "failures": self.examples}


def run(seed: int = 0, n: int = 1000, bound_s: float = 10) -> Counts:
    """Feed ``n`` cases to parse_spec and count the outcomes (main thread only: SIGPROF stops
    a case that has used ``bound_s`` seconds of CPU)."""
    counts = Counts()
    previous = signal.signal(signal.SIGPROF, _alarm)
    try:
        for kind, text in cases(seed, n):
            per_kind = counts.by_kind.setdefault(kind, Counter())
            start = time.process_time()
            outcome, detail = "accepted", ""
            signal.setitimer(signal.ITIMER_PROF, bound_s)
            try:
                parse_spec(text, PATH)
            except _Hang:
                outcome, detail = "hangs", f"over {bound_s} s of CPU"
            except SpecError as e:
                rendered = str(e)
                if rendered.startswith(PATH):
                    outcome = "refused"
                else:
                    outcome, detail = "unlocated", rendered[:300]
            except Exception as e:  # noqa: BLE001 - counting every escape is the point
                outcome, detail = "other", "".join(traceback.format_exception_only(type(e), e))[-300:]
            finally:
                signal.setitimer(signal.ITIMER_PROF, 0)
            took = time.process_time() - start
            if took > counts.slowest_s:
                counts.slowest_s, counts.slowest_kind = took, kind
            setattr(counts, outcome, getattr(counts, outcome) + 1)
            per_kind[outcome] += 1
            if detail and len(counts.examples) < 10:
                counts.examples.append({"kind": kind, "outcome": outcome, "detail": detail,
                                        "text": ascii(text[:200])})
    finally:
        signal.signal(signal.SIGPROF, previous)
    counts.by_kind = {k: dict(v) for k, v in counts.by_kind.items()}
    return counts
