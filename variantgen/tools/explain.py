"""`variantgen explain`: what a spec's mask is for one request, and how plan() splits it.

A model author writes a mask and wants to see it before any GPU is involved. For one
request of ``qo_len`` queries and ``kv_len`` keys (queries at the last positions, as in
chunked prefill) this shows:

* the mask as a text grid, rows = queries (with q_pos), columns = keys, evaluated by the
  derived reference (the same expression tree the kernel is generated from);
* the key intervals the planner derives (intervals.analyze: the mask as a union of terms,
  each row's interval [lo, hi] and whether it is exact or a hull);
* which rows run dense / causal / window / custom, and the launch requests they form
  (cost.planned_requests: the row rules the spec's planner module runs on the GPU, in torch ops,
  with rows that see several key intervals split into pieces, as plan() does);
* the cost: keys the launch requests read against keys the mask shows, per launch class and in
  total (cost.py). Requests of up to MAX_REQUEST tokens are planned and costed; the grid and the
  rows are drawn only up to MAX_GRID.

Spec arguments come from ``--arg name=value`` (parse_arg documents the forms); tensors not
given get the random values the tests use (wrappers.batches.random_spec_args), scalars their defaults.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..lang.values import ScalarArg, TensorArg, VariantSpec

if TYPE_CHECKING:  # torch is imported where it is used: the CLI's help reads ARG_FORMS from here
    import torch

    from ..planning.cost import Cost
    from ..planning.intervals import IntervalForm

MAX_GRID = 256  # queries or keys: a wider grid does not fit a terminal
MAX_REQUEST = 65536  # queries or keys explain plans and costs (counting: no dense grid beyond MAX_GRID)
MAX_LAUNCH_LINES = 64  # launch requests listed in the text
VISIBLE, MASKED = "#", "."
CLASS_NAMES = ("dense", "causal", "window", "custom", "tail")  # plan_abi.RowClass
ARG_FORMS = """\
--arg NAME=VALUE (repeatable). A scalar: a number (true / false for a bool). A tensor: one number
(every element), a comma list of all its elements (row-major), runs COUNTxVALUE (e.g.
doc_ids=5x0,7x1 for 12 keys), or for a [total_q, 2] span tensor the spans S-E,... of key positions
each query in them sees (e.g. ranges=2-5,8-9; `none`: no span). Dims: total_q = --qo,
total_kv = --kv, batch = 1, num_qo_heads = --heads, num_kv_heads = 1. Tensors not given get
random values (--seed), scalars their defaults."""
_SPAN = re.compile(r"^(\d+)-(\d+)$")
_RUN = re.compile(r"^(\d+)x(.+)$")


@dataclass(frozen=True)
class ArgValue:
    name: str
    value: Any  # torch.Tensor for tensors; bool / int / float for scalars
    source: str  # "given", "default" or "random"


@dataclass(frozen=True)
class RowInfo:
    q_pos: int
    lo: int
    hi: int
    exact: bool
    empty: bool
    cls: str  # dense / causal / window / custom, or "" with the planner off
    param: int  # the window width for window rows, the fixed first key for causal rows
    outside: int  # visible keys outside [lo, hi]: nonzero means the intervals are wrong
    dense_hi: int = -1  # [lo, dense_hi] all visible (a hull row's dense start; lo - 1: none)
    hidden: int = 0  # keys of [lo, dense_hi] the mask hides: nonzero means the intervals are wrong


@dataclass(frozen=True)
class LaunchRequest:
    rows: tuple[int, int]  # first row, end row (exclusive), request-local
    cls: str
    mode: str  # the kernel's mask mode: none / causal / custom
    keys: tuple[int, int]  # first key read, end key (exclusive)
    pages: int
    window: int  # the kernel's left window, -1 for none
    visible: tuple[int, int] = (0, -1)  # custom: keys every row sees, where the mask is skipped (empty: hi < lo)
    piece: int = -1  # its rows' key interval it reads (0, 1, ...: merged by LSE after the launches; -1: in place)
    gaps: tuple[tuple[int, int], ...] = ()  # key ranges [from, to) its page list skips


@dataclass(frozen=True)
class Explanation:
    spec: VariantSpec
    qo_len: int
    kv_len: int
    page_size: int
    head: int
    args: dict[str, ArgValue]
    mask: torch.Tensor | None  # bool [qo_len, kv_len]; None beyond MAX_GRID (no grid drawn)
    form: IntervalForm
    rows: tuple[RowInfo, ...]  # () beyond MAX_GRID
    launches: tuple[LaunchRequest, ...]
    segment_counts: dict[str, int]
    cost: Cost | None = None


# ----------------------------------------------------------------------------- arguments


def dims(qo_len: int, kv_len: int, heads: int) -> dict[str, int]:
    return {"total_q": qo_len, "total_kv": kv_len, "batch": 1, "num_qo_heads": heads, "num_kv_heads": 1}


def parse_arg(spec: VariantSpec, item: str, dim_sizes: dict[str, int]) -> ArgValue:
    """One ``--arg NAME=VALUE`` (forms: ARG_FORMS); ValueError naming the argument otherwise."""
    name, sep, text = item.partition("=")
    name, text = name.strip(), text.strip()
    if not sep or not name or not text:
        raise ValueError(f"--arg {item!r}: expected NAME=VALUE")
    tensors = {t.name: t for t in spec.tensors}
    scalars = {s.name: s for s in spec.scalars}
    if name in scalars:
        return ArgValue(name, _scalar(scalars[name], text), "given")
    if name in tensors:
        return ArgValue(name, _tensor(tensors[name], text, dim_sizes), "given")
    takes = ", ".join([*tensors, *scalars]) or "no arguments"
    raise ValueError(f"--arg {name}=...: spec `{spec.name}` has no argument {name!r} (it takes: {takes})")


def _scalar(arg: ScalarArg, text: str) -> bool | int | float:
    where = f"--arg {arg.name}={text}"
    if arg.dtype == "bool":
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"{where}: expected true or false (a bool scalar)")
        return text.lower() in ("true", "1")
    try:
        return int(text) if arg.dtype == "int" else float(text)
    except ValueError:
        raise ValueError(f"{where}: expected {'a whole number' if arg.dtype == 'int' else 'a number'} "
                         f"({arg.dtype} scalar)") from None


def _tensor(arg: TensorArg, text: str, dim_sizes: dict[str, int]) -> torch.Tensor:
    import torch

    where = f"--arg {arg.name}={text}"
    shape = tuple(dim_sizes[d] if isinstance(d, str) else d for d in arg.shape)
    shape_text = "[" + ", ".join(f"{d}={dim_sizes[d]}" if isinstance(d, str) else str(d) for d in arg.shape) + "]"
    dtype = torch.int32 if arg.dtype == "int32" else torch.float32
    items = [p.strip() for p in text.split(",")]
    if arg.shape == ("total_q", 2) and (text == "none" or all(_SPAN.match(p) for p in items)):
        from ..wrappers.spans import spans_to_ranges

        spans = [] if text == "none" else [tuple(int(x) for x in _SPAN.match(p).groups()) for p in items]
        try:
            return spans_to_ranges([dim_sizes["total_q"]], [dim_sizes["total_kv"]], [spans])
        except ValueError as e:
            raise ValueError(f"{where}: {str(e).removeprefix('spans_to_ranges: ')}") from None
    values: list[float] = []
    for p in items:
        run = _RUN.match(p)
        count, value = (int(run.group(1)), run.group(2)) if run else (1, p)
        values += [_number(value, arg, where)] * count
    n = 1
    for d in shape:
        n *= d
    if len(values) == 1:
        values *= n
    if len(values) != n:
        raise ValueError(f"{where}: {len(values)} value(s) for {arg.dtype} tensor `{arg.name}` of shape {shape_text} "
                         f"({n} elements); give one number, all {n}, or runs COUNTxVALUE")
    return torch.tensor(values, dtype=dtype).reshape(shape)


def _number(text: str, arg: TensorArg, where: str) -> float:
    try:
        return int(text) if arg.dtype == "int32" else float(text)
    except ValueError:
        kind = "whole numbers" if arg.dtype == "int32" else "numbers"
        raise ValueError(f"{where}: {text!r} is not a number (`{arg.name}` holds {kind})") from None


def check_request(qo_len: int, kv_len: int, *, page_size: int = 16, heads: int = 1, head: int = 0,
                  limit: int = MAX_REQUEST) -> None:
    """ValueError naming the option unless the request has at most ``limit`` queries and keys."""
    for name, value, lo, hi in (("--qo", qo_len, 1, limit), ("--kv", kv_len, 1, limit),
                                ("--page-size", page_size, 1, 1 << 20), ("--heads", heads, 1, 1 << 10)):
        if not lo <= value <= hi:
            raise ValueError(f"{name}={value}: expected {lo} <= {name[2:]} <= {hi}")
    if qo_len > kv_len:
        raise ValueError(f"--qo={qo_len} > --kv={kv_len}: a request's queries are its last keys (qo <= kv)")
    if not 0 <= head < heads:
        raise ValueError(f"--head={head}: expected 0 <= head < --heads={heads}")


def resolve_args(spec: VariantSpec, items: Sequence[str], qo_len: int, kv_len: int, heads: int,
                 seed: int) -> dict[str, ArgValue]:
    """Every spec argument: the given ones, random tensors (as the tests draw them) and default
    scalars for the rest."""
    from ..wrappers.batches import random_paged_batch, random_spec_args

    check_request(qo_len, kv_len, heads=heads)
    sizes = dims(qo_len, kv_len, heads)
    out: dict[str, ArgValue] = {}
    for item in items:
        arg = parse_arg(spec, item, sizes)
        if arg.name in out:
            raise ValueError(f"--arg {arg.name}= is given twice")
        out[arg.name] = arg
    if any(t.name not in out for t in spec.tensors):
        batch = random_paged_batch([qo_len], [kv_len], num_qo_heads=heads, num_kv_heads=1, head_dim=8, page_size=1,
                                   seed=seed)
        for name, value in random_spec_args(spec, batch, seed=seed).items():
            out.setdefault(name, ArgValue(name, value, "random"))
    for s in spec.scalars:
        out.setdefault(s.name, ArgValue(s.name, s.default, "default"))
    ordered = {name: out[name] for name in [*spec.tensor_names, *spec.scalar_names]}
    check_args(spec, ordered, qo_len, kv_len, heads)
    return ordered


def check_args(spec: VariantSpec, args: dict[str, ArgValue], qo_len: int, kv_len: int, heads: int) -> None:
    """The checks plan() and run() make of the spec's arguments (scalar ranges such as
    ``positive: true``, tensor dtypes and shapes): a grid of arguments they would refuse is not
    drawn. ValueError naming the --arg (or the argument, for one not given)."""
    import torch

    from ..core.errors import LaunchError
    from ..wrappers.checks import check_spec_args

    values = {name: a.value for name, a in args.items()}
    try:
        check_spec_args(spec, values, dims(qo_len, kv_len, heads), torch.device("cpu"), where="explain")
    except LaunchError as e:
        text = str(e).removeprefix("explain: ")
        given = [a for a in args.values() if a.source == "given" and f"`{a.name}`" in text]
        where = f"--arg {given[0].name}={_value_text(given[0].value)}" if given else "explain"
        raise ValueError(f"{where}: {text} (plan() and run() refuse it too)") from None


# ----------------------------------------------------------------------------- explain


def explain(spec: VariantSpec, qo_len: int, kv_len: int, args: dict[str, ArgValue], *, page_size: int = 16,
            head: int = 0, heads: int = 1) -> Explanation:
    """The mask grid, per-row intervals and planner classes for one request (CPU)."""
    import torch

    from ..planning.cost import cost_of, planned_requests, visible_keys
    from ..planning.intervals import analyze, row_intervals
    from ..planning.plan import LaunchRequest as Planned
    from ..planning.rowrules import classify_rows
    from ..wrappers.reference import RequestGrid, mask_for_request

    check_request(qo_len, kv_len, page_size=page_size, heads=heads, head=head)
    check_args(spec, args, qo_len, kv_len, heads)
    values = {name: a.value for name, a in args.items()}
    cpu = torch.device("cpu")
    small = qo_len <= MAX_GRID and kv_len <= MAX_GRID
    grid = RequestGrid(0, qo_len, kv_len, 0, 0, heads, 1, cpu)
    mask = mask_for_request(spec, grid, values)[head].clone() if small else None
    form = analyze(spec)
    planned: list[Planned] = []
    q_pos = torch.arange(kv_len - qo_len, kv_len, dtype=torch.int64)
    rows: list[RowInfo] = []
    launches: list[LaunchRequest] = []
    counts: dict[str, int] = {}
    if form.planner_ready:
        i64 = torch.int64
        env = {"q_pos": q_pos, "q_idx": q_pos - (kv_len - qo_len), "q_row": q_pos - (kv_len - qo_len),
               "q_kv_row": q_pos, "request": torch.zeros(qo_len, dtype=i64),
               "qo_len": torch.full((qo_len,), qo_len, dtype=i64), "kv_len": torch.full((qo_len,), kv_len, dtype=i64),
               "vg_kv_lens": torch.tensor([kv_len], dtype=i64)}
        iv = row_intervals(form, spec, env, values)
        rec = classify_rows(spec, form, [0, qo_len], [kv_len], page_size, values, cpu)
        for r in range(qo_len if small else 0):
            lo, hi = int(iv.lo[r]), int(iv.hi[r])
            visible = mask[r].nonzero().flatten().tolist()
            outside = sum(1 for k in visible if not lo <= k <= hi) if not bool(iv.empty[r]) else len(visible)
            dense_hi = int(iv.dense_hi[r])
            hidden = int((~mask[r, lo:dense_hi + 1]).sum()) if dense_hi >= lo else 0
            cls = int(rec[2, r])
            rows.append(RowInfo(int(q_pos[r]), lo, hi, bool(iv.exact[r]), bool(iv.empty[r]), CLASS_NAMES[cls],
                                int(rec[3, r]), outside, dense_hi, hidden))
        counts = dict.fromkeys(CLASS_NAMES, 0) | {"custom_rows": 0}
        # the launch requests fa2 runs (fa3: a window launch each), rows of several intervals split
        planned, _ = planned_requests(spec, values, [qo_len], [kv_len], page_size)
        for la in planned:
            launches.append(LaunchRequest(la.rows, la.cls.label, la.mode.label, la.keys, la.pages, la.window,
                                          la.visible, la.piece, la.gaps))
            counts[la.cls.label] += 1
            counts["custom_rows"] += (la.rows[1] - la.rows[0]) if la.cls.label == "custom" and la.piece <= 0 else 0
    elif small:
        rows = [RowInfo(int(p), 0, kv_len - 1, False, False, "", 0, 0) for p in q_pos]
    visible, hull_rows = visible_keys(spec, values, [qo_len], [kv_len])  # (query head 0 where the mask reads heads)
    cost = cost_of(planned, visible, [qo_len], [kv_len], reason=form.reason, hull_rows=hull_rows,
                   planner_on=form.planner_ready)
    return Explanation(spec, qo_len, kv_len, page_size, head, args, mask, form, tuple(rows), tuple(launches), counts,
                       cost)


# ----------------------------------------------------------------------------- text


def render(e: Explanation) -> str:
    first_q = e.kv_len - e.qo_len
    out = [f"spec `{e.spec.name}`: one request of {e.qo_len} queries (q_pos {first_q}..{e.kv_len - 1}) and "
           f"{e.kv_len} keys (kv_pos 0..{e.kv_len - 1}); page size {e.page_size}" +
           (f"; query head {e.head}" if e.head else "")]
    out.append(f"mask: {' '.join(e.spec.mask_text.split())}")
    if e.spec.sink_text is not None:  # a logit per head in every row's denominator: not in the grid
        out.append(f"sink: {' '.join(e.spec.sink_text.split())} (a learned logit per head in each row's softmax; "
                   "the grid shows the mask only)")
    if e.args:
        out.append("arguments:")
        for a in e.args.values():
            out.append(f"  {a.name} = {_value_text(a.value)}  ({a.source})")
    out.append("")
    if e.mask is None:
        out.append(f"(the mask grid and its rows are drawn for requests of up to {MAX_GRID} queries and keys)")
    else:
        out += _grid(e)
    out.append("")
    if not e.form.planner_ready:
        out.append(f"interval planner: off ({e.form.reason}); every row runs the custom mask over all its keys")
        out += _cost_lines(e)
        return "\n".join(out)
    out.append("key intervals (the mask as a union of terms; a row that sees several runs of them split into "
               "pieces, else their hull):")
    for i, term in enumerate(e.form.terms):
        out.append(f"  term {i + 1}: {term.describe() or 'every key'}")
    wrong = [info for info in e.rows if info.outside or info.hidden]
    if wrong:
        out.append(f"  WARNING: {len(wrong)} row(s) see keys outside their interval (an intervals bug: please report)")
    out.append("")
    out.append(f"launch requests (rows grouped by class; pages of {e.page_size} keys):")
    for la in e.launches[:MAX_LAUNCH_LINES]:
        rows = f"rows {la.rows[0]}-{la.rows[1] - 1}" if la.rows[1] - la.rows[0] > 1 else f"row {la.rows[0]}"
        qp = f"q_pos {first_q + la.rows[0]}-{first_q + la.rows[1] - 1}"
        window = f", kernel window {la.window}" if la.window >= 0 else ""
        tail = (" (fa2, while rows x GQA group fit one query tile: the mask on the diagonal tile only; "
                f"otherwise, and on fa3, custom, the mask skipped on keys {la.visible[0]}-{la.visible[1]})"
                if la.cls == "tail" else "")
        if la.cls == "custom" and la.visible[1] >= la.visible[0]:
            tail = f", the mask skipped on keys {la.visible[0]}-{la.visible[1]} (visible to every row)"
        skips = "".join(f", skipping keys {f}-{t - 1}" for f, t in la.gaps)
        piece = f", piece {la.piece}" if la.piece >= 0 else ""
        out.append(f"  {rows:12} ({qp}): {la.cls:6}  keys {la.keys[0]}-{la.keys[1] - 1} ({la.pages} page(s)"
                   f"{skips}), mask mode {la.mode}{window}{piece}{tail}")
    if len(e.launches) > MAX_LAUNCH_LINES:
        out.append(f"  ... and {len(e.launches) - MAX_LAUNCH_LINES} more launch requests")
    c = e.segment_counts
    if c:
        tail = f"{c['tail']} tail, " if c.get("tail") else ""
        out.append(f"  {c.get('dense', 0)} dense, {c.get('causal', 0)} causal, {c.get('window', 0)} window, {tail}"
                   f"{c.get('custom', 0)} custom ({c.get('custom_rows', 0)} of {e.qo_len} rows evaluate the mask on "
                   "every key they read but those known visible)")
    out += _cost_lines(e)
    return "\n".join(out)


def _grid(e: Explanation) -> list[str]:
    out = [f"mask grid ({VISIBLE} visible, {MASKED} masked); per row: the planner's key interval and row class"]
    tens = "".join(str(k // 10 % 10) if k % 10 == 0 and k >= 10 else " " for k in range(e.kv_len))
    ones = "".join(str(k % 10) for k in range(e.kv_len))
    pad = " " * len("q_pos 0000  ")
    if e.kv_len > 10:
        out.append(pad + tens.rstrip())
    out.append("kv_pos".ljust(len(pad)) + ones)
    for r, info in enumerate(e.rows):
        cells = "".join(VISIBLE if v else MASKED for v in e.mask[r].tolist())
        out.append(f"q_pos {info.q_pos:4d}  {cells}  {_row_text(e, info)}")
    return out


def _cost_lines(e: Explanation) -> list[str]:
    c = e.cost
    if c is None:
        return []
    out = ["", f"cost: keys read {c.keys_read} for {c.keys_visible} visible ({_ratio(c.keys_read, c.keys_visible)} "
           "read per visible key; 1.00: nothing read that the mask hides)"]
    for name, k in c.by_class.items():
        out.append(f"  {name:7} {k.launch_requests:5} launch request(s), {k.rows:6} rows: keys read {k.keys_read}, "
                   f"visible {k.keys_visible} ({_ratio(k.keys_read, k.keys_visible)})")
    return out


def _ratio(read: int, visible: int) -> str:
    return f"{read / visible:.2f}x" if visible else ("-" if not read else "inf")


def to_json(e: Explanation) -> dict[str, Any]:
    """What `variantgen explain --json` prints: the cost, the planner's terms and launch requests,
    and (up to MAX_GRID) the grid's rows."""
    args = {a.name: {"value": _json_value(a.value), "source": a.source} for a in e.args.values()}
    out: dict[str, Any] = {"spec": e.spec.name, "qo_len": e.qo_len, "kv_len": e.kv_len, "page_size": e.page_size,
                           "args": args}
    out |= e.cost.to_json() if e.cost is not None else {}
    out["terms"] = [t.describe() for t in e.form.terms] if e.form.planner_ready else []
    out["launch_requests"] = [{"rows": list(la.rows), "class": la.cls, "mode": la.mode, "keys": list(la.keys),
                               "pages": la.pages, "window": la.window, "piece": la.piece,
                               "gaps": [list(g) for g in la.gaps]} for la in e.launches]
    if e.mask is not None:
        out["grid"] = ["".join(VISIBLE if v else MASKED for v in row) for row in e.mask.tolist()]
        out["row_intervals"] = [{"q_pos": r.q_pos, "lo": r.lo, "hi": r.hi, "exact": r.exact, "empty": r.empty,
                                 "class": r.cls} for r in e.rows]
    return out


def _json_value(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.tolist() if value.numel() <= 64 else f"{list(value.shape)} tensor"
    return value


def _row_text(e: Explanation, info: RowInfo) -> str:
    if not e.form.planner_ready:
        return ""
    if info.empty or info.hi < info.lo:  # never an inverted pair such as "[4, 3] hull"
        interval = "no key (empty)"
    elif not info.exact and info.dense_hi >= info.lo:  # a dense start, then the hull
        interval = f"[{info.lo}, {info.dense_hi}] dense + [{info.dense_hi + 1}, {info.hi}] hull"
    else:
        interval = f"[{info.lo}, {info.hi}] {'exact' if info.exact else 'hull'}"
    cls = info.cls + (f" w={info.param}" if info.cls == "window" else "")
    pieces = sum(1 for la in e.launches if la.piece >= 0 and la.rows[0] <= info.q_pos - (e.kv_len - e.qo_len)
                 < la.rows[1])
    if pieces:  # (the row's hull is not read: each of its intervals is a launch request, merged by LSE)
        cls = f"split into {pieces} pieces"
    flag = f"  ! {info.outside} visible key(s) outside" if info.outside else ""
    flag += f"  ! {info.hidden} masked key(s) in the dense part" if info.hidden else ""
    return f"{interval:18} {cls}{flag}"


def _value_text(value: Any) -> str:
    import torch

    if not isinstance(value, torch.Tensor):
        return repr(value)
    rows = value.tolist() if value.dim() == 2 else value.flatten().tolist()
    shown = rows[:24]

    def one(v: Any) -> str:
        if isinstance(v, list):
            return "(" + ", ".join(one(x) for x in v) + ")"
        return f"{v:g}" if isinstance(v, float) else str(v)

    more = f", ... ({len(rows)} in all)" if len(rows) > len(shown) else ""
    return f"{list(value.shape)} [{', '.join(one(v) for v in shown)}{more}]"
