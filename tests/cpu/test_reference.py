"""The torch reference: masks of every shipped spec against hand-written loops, softmax
against a naive implementation, and the language's integer semantics (floor division,
modulo, zero divisors, index clamping)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import pytest
import torch
from conftest import SPEC_FILES, SPECS_DIR
from hypothesis import given, settings
from hypothesis import strategies as st

import variantgen
from variantgen.core.errors import LaunchError
from variantgen.lang import evaluate
from variantgen.wrappers import checks
from variantgen.wrappers.reference import RequestGrid, mask_for_request, reference_attention, transform_logits

H_QO, H_KV, D, PAGE = 4, 2, 8, 4
QO_LENS = (3, 2)
KV_LENS = (7, 9)  # qo_len < kv_len: chunked prefill over a cached prefix


def shipped(name: str):
    return variantgen.load_spec(SPECS_DIR / f"{name}.yaml")


@dataclass(frozen=True)
class Pos:
    """One (request, head, query, key) cell, with every builtin as plain ints."""

    b: int
    h: int
    i: int  # q_idx
    j: int  # kv_pos
    qo_len: int
    kv_len: int
    q_row_base: int
    kv_row_base: int

    @property
    def q(self) -> int:  # q_pos
        return self.kv_len - self.qo_len + self.i

    @property
    def q_row(self) -> int:
        return self.q_row_base + self.i

    @property
    def kv_row(self) -> int:
        return self.kv_row_base + self.j

    @property
    def q_kv_row(self) -> int:
        return self.kv_row_base + self.q

    @property
    def kv_head(self) -> int:
        return self.h // (H_QO // H_KV)


# Arguments used for each shipped spec: chosen so that every clause of the mask matters.
DOC_IDS = [0, 0, 0, 1, 1, 1, 1] + [5, 5, 6, 6, 6, 6, 7, 7, 7]  # [total_kv] = 7 + 9 rows
RANGES = [[0, 5], [-1, -1], [2, 6], [3, 8], [0, 0]]  # [total_q] = 3 + 2 rows, inclusive spans
ARGS = {
    "causal": {},
    "sliding_window": {"window": 2},
    "streaming_sink": {"num_sink": 2, "window": 1},
    "chunked_local": {"chunk_size": 4},
    "document": {"doc_ids": torch.tensor(DOC_IDS, dtype=torch.int32)},
    "mm_prefix": {"ranges": torch.tensor(RANGES, dtype=torch.int32), "causal_window_left": 1,
                  "range_window_left": 4},
    "prefix_lm": {"prefix_len": torch.tensor([6, 0], dtype=torch.int32)},
    "softcap": {"soft_cap": 0.5, "window": 3},
    "alibi": {"slopes": torch.tensor([0.5, 0.25, 0.125, 0.0625])},
    "attention_sink_learned": {"sinks": torch.tensor([0.5, -1.0, 2.0, -30.0]), "window": 3},
}
SINKS = {"attention_sink_learned": lambda args, b, h: float(args["sinks"][h])}
# tree_verify: request 0 verifies a root with two children, request 1 two roots (a forest)
TREE_PARENTS = [[-1, 0, 0], [-1, -1]]
ARGS["tree_verify"] = {"tree_bits": torch.tensor([[1, 0], [3, 0], [5, 0], [1, 0], [2, 0]], dtype=torch.int32)}
# gemma4_sliding: request 0's queries at positions 4 and 5 end the image block [2, 5]; its third
# (position 6) and request 1's are text; window 3
GEMMA4_BLOCKS = [[2, 5], [2, 5], [-1, -1], [-1, -1], [-1, -1]]
ARGS["gemma4_sliding"] = {"ranges": torch.tensor(GEMMA4_BLOCKS, dtype=torch.int32), "window": 3}


def _scalar(args, name, spec):
    return args.get(name, next(s.default for s in spec.scalars if s.name == name))


def expected_visible(name: str, spec, args, p: Pos) -> bool:
    """What each spec's mask means, written out (not derived from its expression tree)."""
    causal = p.j <= p.q
    if name in ("causal", "alibi"):
        return causal
    if name == "attention_sink_learned":  # gpt-oss: the window counts keys (q_pos - kv_pos < window)
        w = _scalar(args, "window", spec)
        return causal and (w <= 0 or p.q - p.j < w)
    if name in ("sliding_window", "softcap"):
        w = _scalar(args, "window", spec)
        return causal and (w < 0 or p.q - p.j <= w)
    if name == "streaming_sink":
        return causal and (p.j < _scalar(args, "num_sink", spec) or p.q - p.j <= _scalar(args, "window", spec))
    if name == "chunked_local":
        c = _scalar(args, "chunk_size", spec)
        return causal and p.j // c == p.q // c
    if name == "document":
        return causal and DOC_IDS[p.kv_row] == DOC_IDS[p.q_kv_row]
    if name == "mm_prefix":
        cw, rw = _scalar(args, "causal_window_left", spec), _scalar(args, "range_window_left", spec)
        lo, hi = RANGES[p.q_row]
        in_causal = causal and (cw < 0 or p.q - p.j <= cw)
        in_range = lo <= p.j <= hi and (rw <= 0 or p.q - p.j < rw)
        return in_causal or in_range
    if name == "prefix_lm":
        prefix = [6, 0][p.b]
        return p.j < prefix or causal
    if name == "gemma4_sliding":  # transformers: kv > q - window and (kv <= q or the query's own block)
        lo, hi = GEMMA4_BLOCKS[p.q_row]
        return p.j > p.q - _scalar(args, "window", spec) and (causal or lo <= p.j <= hi)
    if name == "tree_verify":  # the cached context, then the node itself and its ancestors
        ctx = p.kv_len - p.qo_len
        ancestors, node = {p.i}, p.i
        while TREE_PARENTS[p.b][node] >= 0:
            node = TREE_PARENTS[p.b][node]
            ancestors.add(node)
        return p.j < ctx or p.j - ctx in ancestors
    raise AssertionError(f"no meaning written for {name}")


def expected_logit(name: str, spec, args, p: Pos, s: float) -> float:
    if name == "alibi":
        return s + [0.5, 0.25, 0.125, 0.0625][p.h] * (p.j - p.q)
    if name == "softcap":
        cap = _scalar(args, "soft_cap", spec)
        return cap * math.tanh(s / cap)
    assert spec.logits is None
    return s


def test_every_shipped_spec_has_a_written_meaning():
    assert {p.stem for p in SPEC_FILES} <= set(ARGS)


# ----------------------------------------------------------------------------- batch helpers


@dataclass
class Batch:
    q: torch.Tensor  # [total_q, H_QO, D]
    k: list[torch.Tensor]  # per request [kv_len, H_KV, D]
    v: list[torch.Tensor]
    kv_cache: torch.Tensor  # [num_pages, 2, PAGE, H_KV, D]
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    last_page_len: torch.Tensor
    qo_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]

    def positions(self):
        q_base = kv_base = 0
        for b, (qo_len, kv_len) in enumerate(zip(self.qo_lens, self.kv_lens)):
            for h in range(H_QO):
                for i in range(qo_len):
                    for j in range(kv_len):
                        yield Pos(b, h, i, j, qo_len, kv_len, q_base, kv_base)
            q_base += qo_len
            kv_base += kv_len

    def grid(self, b: int) -> RequestGrid:
        return RequestGrid(b, self.qo_lens[b], self.kv_lens[b], sum(self.qo_lens[:b]), sum(self.kv_lens[:b]),
                           H_QO, H_KV, torch.device("cpu"))


def make_batch(qo_lens=QO_LENS, kv_lens=KV_LENS, seed=0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(qo_lens), H_QO, D, generator=gen)
    ks = [torch.randn(n, H_KV, D, generator=gen) for n in kv_lens]
    vs = [torch.randn(n, H_KV, D, generator=gen) for n in kv_lens]
    pages_per = [max(1, math.ceil(n / PAGE)) if n else 0 for n in kv_lens]
    total_pages = sum(pages_per) + 2
    order = torch.randperm(total_pages, generator=gen).tolist()  # pages scattered over the pool
    cache = torch.full((total_pages, 2, PAGE, H_KV, D), float("nan"))  # unused slots poison the result
    indices, indptr, last = [], [0], []
    for n, k, v, npages in zip(kv_lens, ks, vs, pages_per):
        mine = [order.pop() for _ in range(npages)]
        for p_i, page in enumerate(mine):
            rows = slice(p_i * PAGE, min(n, (p_i + 1) * PAGE))
            count = rows.stop - rows.start
            cache[page, 0, :count] = k[rows]
            cache[page, 1, :count] = v[rows]
        indices += mine
        indptr.append(len(indices))
        last.append(n - (npages - 1) * PAGE if npages else 0)
    qo_indptr = torch.tensor([0, *torch.tensor(qo_lens).cumsum(0).tolist()], dtype=torch.int32)
    return Batch(q, ks, vs, cache, qo_indptr, torch.tensor(indptr, dtype=torch.int32),
                 torch.tensor(indices, dtype=torch.int32), torch.tensor(last, dtype=torch.int32),
                 tuple(qo_lens), tuple(kv_lens))


def naive_attention(batch: Batch, visible, logit, sm_scale: float, sink=None):
    """Per (token, head) softmax in float64 with Python loops. Returns (out, lse base 2).
    ``sink(b, h)``: a logit in every row's denominator that has no value (learned sinks)."""
    total_q = batch.q.shape[0]
    out = torch.zeros(total_q, H_QO, D, dtype=torch.float64)
    lse = torch.full((total_q, H_QO), -math.inf, dtype=torch.float64)
    cells = {}
    for p in batch.positions():
        cells.setdefault((p.b, p.h, p.i), []).append(p)
    for (b, h, _), row in cells.items():
        t = row[0].q_row
        q = batch.q[t, h].double()
        scores = []
        for p in row:
            k = batch.k[b][p.j, p.kv_head].double()
            s = float((q * k).sum()) * sm_scale
            s = logit(p, s)
            if visible(p):
                scores.append((s, p.j))
        s_h = sink(b, h) if sink is not None else None
        if not scores:
            if s_h is not None:  # only the sink: no value, all its weight
                lse[t, h] = s_h / math.log(2.0)
            continue
        m = max([s for s, _ in scores] + ([s_h] if s_h is not None else []))
        weights = [(math.exp(s - m), j) for s, j in scores]
        total = sum(w for w, _ in weights) + (math.exp(s_h - m) if s_h is not None else 0.0)
        acc = torch.zeros(D, dtype=torch.float64)
        for w, j in weights:
            acc += (w / total) * batch.v[b][j, row[0].kv_head].double()
        out[t, h] = acc
        lse[t, h] = (m + math.log(total)) / math.log(2.0)
    return out, lse


def run_reference(spec, batch: Batch, args, **kw):
    return reference_attention(spec, batch.q, batch.kv_cache, batch.qo_indptr, batch.kv_indptr, batch.kv_indices,
                               batch.last_page_len, args, **kw)


# ----------------------------------------------------------------------------- masks


@pytest.mark.parametrize("name", sorted(ARGS))
def test_mask_of_every_shipped_spec(name):
    spec = shipped(name)
    args = ARGS[name]
    batch = make_batch()
    for b in range(len(batch.qo_lens)):
        got = mask_for_request(spec, batch.grid(b), args)
        assert got.shape == (H_QO, batch.qo_lens[b], batch.kv_lens[b]) and got.dtype == torch.bool
        want = torch.zeros_like(got)
        for p in batch.positions():
            if p.b == b:
                want[p.h, p.i, p.j] = expected_visible(name, spec, args, p)
        assert torch.equal(got, want), f"{name} request {b}:\n{got.int()}\n!=\n{want.int()}"
        assert want.any() and not want.all()  # the arguments make the mask non-trivial


@pytest.mark.parametrize("name", sorted(ARGS))
def test_attention_of_every_shipped_spec(name):
    spec = shipped(name)
    args = ARGS[name]
    batch = make_batch(seed=1)
    sm_scale = 1 / math.sqrt(D)
    out, lse = run_reference(spec, batch, args, return_lse=True)
    sink = (lambda b, h: SINKS[name](args, b, h)) if name in SINKS else None
    assert (sink is None) == (spec.sink is None)
    want, want_lse = naive_attention(batch, lambda p: expected_visible(name, spec, args, p),
                                     lambda p, s: expected_logit(name, spec, args, p, s), sm_scale, sink)
    assert out.dtype == torch.float32 and out.shape == (sum(QO_LENS), H_QO, D)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-5, rtol=1e-5)


def test_default_scalar_values_are_used():
    spec = shipped("sliding_window")  # window defaults to 4095: plain causal on a short batch
    batch = make_batch()
    got = mask_for_request(spec, batch.grid(1), {})
    causal = mask_for_request(shipped("causal"), batch.grid(1), {})
    assert torch.equal(got, causal)
    unbounded = mask_for_request(spec, batch.grid(1), {"window": -1})
    assert torch.equal(unbounded, causal)


def test_prefix_longer_than_the_request():
    spec = shipped("prefix_lm")
    batch = make_batch()
    got = mask_for_request(spec, batch.grid(0), {"prefix_len": torch.tensor([100, 0], dtype=torch.int32)})
    assert got.all()


# ----------------------------------------------------------------------------- softmax


def test_softmax_against_naive_with_scales(spec_from):
    spec = shipped("causal")
    batch = make_batch(seed=2)
    out = run_reference(spec, batch, {}, sm_scale=0.3, q_scale=2.0, k_scale=0.5, v_scale=3.0)
    want, _ = naive_attention(batch, lambda p: p.j <= p.q, lambda p, s: s, 0.3)
    torch.testing.assert_close(out.double(), want * 3.0, atol=1e-5, rtol=1e-5)


def test_spec_sm_scale_is_the_default(spec_from):
    spec = spec_from("name: x\nmask: kv_pos <= q_pos\nscales: {sm_scale: 0.05}\n")
    batch = make_batch(seed=3)
    want, _ = naive_attention(batch, lambda p: p.j <= p.q, lambda p, s: s, 0.05)
    torch.testing.assert_close(run_reference(spec, batch, {}).double(), want, atol=1e-5, rtol=1e-5)
    # an explicit sm_scale wins over the spec's
    want2, _ = naive_attention(batch, lambda p: p.j <= p.q, lambda p, s: s, 0.7)
    torch.testing.assert_close(run_reference(spec, batch, {}, sm_scale=0.7).double(), want2, atol=1e-5, rtol=1e-5)


def test_sink_joins_the_denominator(spec_from):
    """o = sum_j exp(l_j - m) v_j / (exp(s_h - m) + sum_j exp(l_j - m)), the LSE with the sink in it;
    a row with no visible key gives 0 and lse = s_h (in base 2). Sinks large and small, per head and
    per request, with a logits transform (the sink is in the transformed logits' domain)."""
    spec = spec_from("name: x\ntensors:\n  s: {dtype: float32, shape: [batch, num_qo_heads]}\n"
                     "mask: kv_pos <= q_pos and q_idx != 1\nlogits: 2.0 * tanh(logits / 2.0)\n"
                     "sink: s[request, qo_head]\n")
    sinks = torch.tensor([[0.0, 3.0, -2.0, 40.0], [-50.0, 1.0, 0.5, -1.0]])
    batch = make_batch(seed=5)
    out, lse = run_reference(spec, batch, {"s": sinks}, sm_scale=0.4, return_lse=True)
    want, want_lse = naive_attention(batch, lambda p: p.j <= p.q and p.i != 1,
                                     lambda p, x: 2.0 * math.tanh(x / 2.0), 0.4, lambda b, h: float(sinks[b, h]))
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    rows_q_idx_1 = [1, 3 + 1]
    assert torch.equal(out[rows_q_idx_1], torch.zeros_like(out[rows_q_idx_1]))
    torch.testing.assert_close(lse[1], sinks[0] / math.log(2.0))
    # a -inf sink is no sink
    no_sink, no_lse = run_reference(spec, batch, {"s": torch.full_like(sinks, -math.inf)}, sm_scale=0.4,
                                    return_lse=True)
    plain, plain_lse = naive_attention(batch, lambda p: p.j <= p.q and p.i != 1,
                                       lambda p, x: 2.0 * math.tanh(x / 2.0), 0.4)
    torch.testing.assert_close(no_sink.double(), plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(no_lse.double(), plain_lse, atol=1e-5, rtol=1e-5)


def test_fully_masked_rows_give_zeros(spec_from):
    spec = spec_from("name: x\nmask: q_idx != 1 and kv_pos <= q_pos\n")
    batch = make_batch(seed=4)
    out, lse = run_reference(spec, batch, {}, return_lse=True)
    rows_q_idx_1 = [1, 3 + 1]  # q_idx 1 of request 0 and of request 1
    for t in range(out.shape[0]):
        if t in rows_q_idx_1:
            assert torch.equal(out[t], torch.zeros_like(out[t]))
            assert torch.isneginf(lse[t]).all()
        else:
            assert torch.isfinite(out[t]).all() and out[t].abs().sum() > 0
            assert torch.isfinite(lse[t]).all()
    nothing = spec_from("name: y\nmask: kv_pos < 0\n")
    out, lse = run_reference(nothing, batch, {}, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_layouts_and_cache_forms_agree():
    spec = shipped("document")
    args = ARGS["document"]
    batch = make_batch(seed=5)
    nhd = run_reference(spec, batch, args)
    k, v = batch.kv_cache.unbind(1)
    as_tuple = reference_attention(spec, batch.q, (k, v), batch.qo_indptr, batch.kv_indptr, batch.kv_indices,
                                   batch.last_page_len, args)
    hnd = reference_attention(spec, batch.q, batch.kv_cache.transpose(2, 3).contiguous(), batch.qo_indptr,
                              batch.kv_indptr, batch.kv_indices, batch.last_page_len, args, kv_layout="HND")
    torch.testing.assert_close(as_tuple, nhd)
    torch.testing.assert_close(hnd, nhd)


def test_empty_request_keeps_kv_rows_aligned():
    # A request with no new queries still owns its [total_kv] rows. Request 2's documents are laid
    # out so that reading its rows 4 too early (request 1's left out) changes which keys its
    # queries see: rows 11..19 hold documents 5, 6, 7 of lengths 3, 2, 4.
    spec = shipped("document")
    batch = make_batch(qo_lens=(3, 0, 2), kv_lens=(7, 4, 9), seed=6)
    doc_ids = torch.tensor([0, 0, 0, 1, 1, 1, 1] + [9, 9, 9, 9] + [5, 5, 5, 6, 6, 7, 7, 7, 7], dtype=torch.int32)
    out = run_reference(spec, batch, {"doc_ids": doc_ids})

    def visible(p):
        return p.j <= p.q and doc_ids[p.kv_row] == doc_ids[p.q_kv_row]

    want, _ = naive_attention(batch, visible, lambda p, s: s, 1 / math.sqrt(D))
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-5)


def test_request_lengths_are_the_wrappers():
    """The reference reads a batch's lengths with the wrappers' checks.paged_batch."""
    assert checks.paged_batch([0, 0, 0, 0], [0, 2, 2, 5], [3, 0, 4], 5, 1, 1, 4).kv_lens == (7, 0, 12)


# ----------------------------------------------------------------------------- argument checks

MM_ARGS = ARGS["mm_prefix"]
REF = "reference_attention(): "


def with_pages(batch: Batch, i: int, page: int) -> torch.Tensor:
    indices = batch.kv_indices.clone()
    indices[i] = page
    return indices


@pytest.mark.parametrize("change, message", [
    (lambda b: dict(q=b.q.tolist()),
     "`q`: expected a floating-point tensor [total_q, num_qo_heads, head_dim_qk], got list"),
    (lambda b: dict(q=b.q[0]),
     "`q`: expected a floating-point tensor [total_q, num_qo_heads, head_dim_qk], got torch.float32 tensor of "
     "shape [4, 8]"),
    (lambda b: dict(q=b.q[:4]), "`q`: expected shape [total_q=5, num_qo_heads, head_dim_qk], got [4, 4, 8]"),
    (lambda b: dict(q=b.q[:, :3]), "num_qo_heads=3 is not a multiple of num_kv_heads=2"),
    (lambda b: dict(q=b.q[..., :4]), "`q`: head_dim_qk=4, but `k_cache` has head_dim=8"),
    (lambda b: dict(paged_kv_cache=b.kv_cache[:, 0]),
     "`paged_kv_cache`: expected (k_cache, v_cache) or one tensor [num_pages, 2, ...]"),
    (lambda b: dict(paged_kv_cache=(b.kv_cache[:, 0], b.kv_cache[:, 1, :, :1])),
     "`k_cache` [7, 4, 2, 8] and `v_cache` [7, 4, 1, 8]: expected the same pages, page size and heads "
     "([pages, page_size, kv_heads, head_dim])"),
    (lambda b: dict(paged_kv_cache=(b.kv_cache[:, 0], b.kv_cache[:, 1].to("meta"))),
     "`v_cache` is on meta, expected cpu (the device of q)"),
    (lambda b: dict(kv_layout="NDH"), "kv_layout='NDH': expected 'NHD' or 'HND'"),
    (lambda b: dict(qo_indptr=b.qo_indptr.long()),
     "`qo_indptr`: expected a 1-D torch.int32 tensor [batch + 1], got torch.int64 tensor of shape [3]"),
    (lambda b: dict(paged_kv_indices=b.kv_indices.to("meta")),
     "`paged_kv_indices` is on meta: expected a tensor on the CPU or a CUDA device (reference_attention() reads "
     "its values)"),
    (lambda b: dict(paged_kv_last_page_len=b.last_page_len[:1]),
     "inconsistent batch: qo_indptr has 3 entries, paged_kv_indptr 3, paged_kv_last_page_len 1 (expected batch+1, "
     "batch+1, batch)"),
    (lambda b: dict(paged_kv_last_page_len=torch.tensor([0, 1], dtype=torch.int32)),
     "paged_kv_last_page_len[0]=0: expected 1..4"),
    (lambda b: dict(paged_kv_indptr=b.kv_indptr + 1), "`paged_kv_indptr`[0]=1: expected 0 (page lists are packed "
                                                      "from the first entry of `paged_kv_indices`)"),
    (lambda b: dict(paged_kv_indices=with_pages(b, 3, 7)),
     "paged_kv_indices[3]=7 is not a page of the KV cache (7 pages: expected 0 <= page < 7)"),
    (lambda b: dict(paged_kv_indices=with_pages(b, 0, -1)),
     "paged_kv_indices[0]=-1 is not a page of the KV cache (7 pages: expected 0 <= page < 7)"),
    (lambda b: dict(args={"causal_window_left": 1}), "missing tensor argument `ranges` (int32, shape ['total_q', 2]: "
                                                     "inclusive absolute key span [start, end] each query token sees; "
                                                     "(-1, -1) for none)"),
    (lambda b: dict(args=dict(MM_ARGS, ranges=MM_ARGS["ranges"][:4])),
     "`ranges`: expected shape [total_q=5, 2], got [4, 2]"),
    (lambda b: dict(args=dict(MM_ARGS, ranges=MM_ARGS["ranges"].long())),
     "`ranges`: expected dtype torch.int32, got torch.int64"),
    (lambda b: dict(args=dict(MM_ARGS, ranges=MM_ARGS["ranges"].to("meta"))),
     "`ranges` is on meta, expected cpu (the device of q)"),
    (lambda b: dict(args=dict(MM_ARGS, causal_windw_left=2)),
     "unexpected argument(s) causal_windw_left (did you mean `causal_window_left`?); spec `mm_prefix` takes: "
     "ranges, causal_window_left, range_window_left (by name in `args`)"),
    (lambda b: dict(args=dict(MM_ARGS, causal_window_left=1.5)),
     "`causal_window_left`: expected an int in 32-bit range, got 1.5 (float)"),
    (lambda b: dict(args=[("ranges", MM_ARGS["ranges"])]),
     "`args`: expected the spec's arguments by name (a dict), got list"),
    (lambda b: dict(q_scale=torch.ones(1)),
     "`q_scale`: expected a finite float, got tensor([1.]) (per-head scale tensors are not supported)"),
    (lambda b: dict(sm_scale=math.nan), "`sm_scale`: expected a finite float, got nan (per-head scale tensors are "
                                        "not supported)"),
    (lambda b: dict(return_lse="yes"), "`return_lse`='yes': expected True or False"),
])
def test_bad_arguments_are_named(change, message):
    """reference_attention checks its arguments with the wrappers' checks (checks.py), prefixed with
    its name (a regression: a bad q, a page outside the cache or a missing spec tensor raised
    AttributeError, IndexError or KeyError from deep inside; a negative page or an int64 indptr
    was read, a misspelt scalar ignored)."""
    spec, batch = shipped("mm_prefix"), make_batch()
    kw = dict(q=batch.q, paged_kv_cache=batch.kv_cache, qo_indptr=batch.qo_indptr, paged_kv_indptr=batch.kv_indptr,
              paged_kv_indices=batch.kv_indices, paged_kv_last_page_len=batch.last_page_len, args=MM_ARGS)
    kw.update(change(batch))
    with pytest.raises(LaunchError, match="^" + re.escape(REF + message) + "$"):
        reference_attention(spec, **kw)


def test_spec_tensors_may_be_strided_views():
    """Unlike a kernel, the reference reads spec tensors through their strides: a view is fine."""
    spec, batch = shipped("mm_prefix"), make_batch()
    wide = torch.stack([MM_ARGS["ranges"], MM_ARGS["ranges"]], dim=1)[:, 0]
    assert not wide.is_contiguous()
    torch.testing.assert_close(run_reference(spec, batch, dict(MM_ARGS, ranges=wide)),
                               run_reference(spec, batch, MM_ARGS))


# ----------------------------------------------------------------------------- integer semantics


def _values(spec, batch: Batch, b: int, args) -> torch.Tensor:
    """The logits transform evaluated on zero scores: [H, qo_len, kv_len] of its value."""
    g = batch.grid(b)
    zeros = torch.zeros(H_QO, g.qo_len, g.kv_len)
    return transform_logits(spec, g, args, zeros)


def _py_floordiv(a: int, b: int) -> int:
    return 0 if b == 0 else a // b


def _py_mod(a: int, b: int) -> int:
    return 0 if b == 0 else a % b


@pytest.mark.parametrize("d", [3, -3, 1, -1, 0, 7])
def test_floordiv_and_mod_follow_python_with_zero_for_zero(spec_from, d):
    div = spec_from("name: a\nscalars:\n  d: {dtype: int, default: 1}\nmask: 'true'\n"
                    "logits: logits + float((kv_pos - q_pos - 2) // d)\n")
    mod = spec_from("name: b\nscalars:\n  d: {dtype: int, default: 1}\nmask: 'true'\n"
                    "logits: logits + float((kv_pos - q_pos - 2) % d)\n")
    batch = make_batch()
    for b in range(2):
        got_div, got_mod = _values(div, batch, b, {"d": d}), _values(mod, batch, b, {"d": d})
        for p in batch.positions():
            if p.b != b:
                continue
            x = p.j - p.q - 2
            assert got_div[p.h, p.i, p.j].item() == _py_floordiv(x, d), (x, d)
            assert got_mod[p.h, p.i, p.j].item() == _py_mod(x, d), (x, d)


def test_float_division_of_ints(spec_from):
    spec = spec_from("name: a\nmask: 'true'\nlogits: logits + (kv_pos - q_pos) / 4\n")
    batch = make_batch()
    got = _values(spec, batch, 1, {})
    for p in batch.positions():
        if p.b == 1:
            assert got[p.h, p.i, p.j].item() == pytest.approx((p.j - p.q) / 4)


def test_negative_operands_in_masks(spec_from):
    # Floor semantics inside a mask: chunks of 3 over q_pos - 5 (negative for early queries).
    spec = spec_from("name: a\nmask: (kv_pos - 5) // 3 == (q_pos - 5) // 3 and (kv_pos - 5) % 3 != 2\n")
    batch = make_batch()
    for b in range(2):
        got = mask_for_request(spec, batch.grid(b), {})
        for p in batch.positions():
            if p.b == b:
                want = (p.j - 5) // 3 == (p.q - 5) // 3 and (p.j - 5) % 3 != 2
                assert bool(got[p.h, p.i, p.j]) == want


def test_index_clamping(spec_from):
    """Fixed-size dimensions clamp any index to their size."""
    spec = spec_from(
        """
        name: clamp
        tensors:
          t: {dtype: float32, shape: [4]}
          u: {dtype: int32, shape: [batch, 3]}
        mask: 'true'
        logits: logits + t[kv_pos - 2] + 100.0 * float(u[request, q_idx - 1])
        """
    )
    t = torch.tensor([1.0, 2.0, 4.0, 8.0])
    u = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32)
    batch = make_batch()
    for b in range(2):
        got = _values(spec, batch, b, {"t": t, "u": u})
        for p in batch.positions():
            if p.b != b:
                continue
            ti, uc = min(max(p.j - 2, 0), 3), min(max(p.i - 1, 0), 2)
            assert got[p.h, p.i, p.j].item() == t[ti].item() + 100.0 * u[p.b, uc].item()


def test_offset_rows_are_clamped_to_their_request(spec_from):
    """`kv_row - 1` at a request's first key reads that key, not the previous request's last;
    `q_row + 1` at its last query reads that query; heads clamp to the head count."""
    spec = spec_from(
        """
        name: offsets
        tensors:
          kv_t: {dtype: float32, shape: [total_kv]}
          q_t: {dtype: float32, shape: [total_q]}
          h_t: {dtype: float32, shape: [num_qo_heads]}
        scalars:
          w: {dtype: int, default: 2}
        mask: 'true'
        logits: >-
          logits + kv_t[kv_row - 1] + 32.0 * kv_t[q_kv_row + w] + 1024.0 * q_t[1 + q_row]
          + 32768.0 * h_t[qo_head + 1] + 524288.0 * kv_t[kv_row + kv_len]
        """
    )
    # Small ints: every sum below is exact in float32.
    kv_t = torch.arange(sum(KV_LENS), dtype=torch.float32) + 1
    q_t = torch.arange(sum(QO_LENS), dtype=torch.float32) + 1
    h_t = torch.arange(H_QO, dtype=torch.float32) + 1
    args = {"kv_t": kv_t, "q_t": q_t, "h_t": h_t}

    def want(p: Pos, w: int) -> float:
        def key(pos: int) -> float:  # key `pos` of p's request, clamped to the request's keys
            return kv_t[p.kv_row_base + min(max(pos, 0), p.kv_len - 1)].item()

        return (key(p.j - 1) + 32.0 * key(p.q + w) + 1024.0 * q_t[p.q_row_base + min(p.i + 1, p.qo_len - 1)].item()
                + 32768.0 * h_t[min(p.h + 1, H_QO - 1)].item() + 524288.0 * key(p.j + p.kv_len))

    batch = make_batch()
    for w in (2, -1000, 0):
        for b in range(2):
            got = _values(spec, batch, b, {**args, "w": w})
            for p in batch.positions():
                if p.b == b:
                    assert got[p.h, p.i, p.j].item() == want(p, w), (p, w)


def test_builtins_across_requests(spec_from):
    spec = spec_from(
        """
        name: rows
        tensors:
          kvb: {dtype: float32, shape: [num_kv_heads]}
        mask: 'true'
        logits: logits + float(q_row * 1000 + kv_row * 10 + request) + 0.5 * kvb[kv_head] + float(qo_len * kv_len)
        """
    )
    kvb = torch.tensor([0.0, 64.0])
    batch = make_batch()
    for b in range(2):
        got = _values(spec, batch, b, {"kvb": kvb})
        for p in batch.positions():
            if p.b == b:
                want = p.q_row * 1000 + p.kv_row * 10 + p.b + 0.5 * kvb[p.kv_head].item() + p.qo_len * p.kv_len
                assert got[p.h, p.i, p.j].item() == want


def test_functions_and_conditionals(spec_from):
    spec = spec_from(
        """
        name: funcs
        scalars:
          c: {dtype: float, default: 2.0}
          flag: {dtype: bool, default: true}
        mask: 'true'
        logits: >-
          logits + min(kv_pos, q_pos, 3) - max(kv_pos, 1.5) + abs(q_pos - kv_pos)
          + sqrt(c) + exp(0.0) + log(c) + sigmoid(0.0) + tanh(0.0)
          + (1 if flag else 2) + (1.0 if not flag else 0.25)
        """
    )
    batch = make_batch()
    got = _values(spec, batch, 0, {})
    for p in batch.positions():
        if p.b == 0:
            want = (min(p.j, p.q, 3) - max(p.j, 1.5) + abs(p.q - p.j) + math.sqrt(2.0) + 1.0 + math.log(2.0) + 0.5
                    + 0.0 + 1 + 0.25)
            assert got[p.h, p.i, p.j].item() == pytest.approx(want, abs=1e-5)
    flipped = _values(spec, batch, 0, {"flag": False})
    assert torch.allclose(flipped - got, torch.full_like(got, 1 + 0.75))


def test_logits_transform_sees_scaled_scores():
    spec = shipped("softcap")
    batch = make_batch()
    scores = torch.linspace(-5, 5, H_QO * 3 * 7).view(H_QO, 3, 7)
    got = transform_logits(spec, batch.grid(0), {"soft_cap": 2.0}, scores)
    torch.testing.assert_close(got, 2.0 * torch.tanh(scores / 2.0))
    # no transform: scores unchanged
    assert transform_logits(shipped("causal"), batch.grid(0), {}, scores) is scores


def test_the_evaluator_over_query_rows_agrees_with_the_grid():
    """evaluate.Evaluator is the one evaluator: over one entry per (query, key) pair it gives
    the mask the reference computes over the request's grid."""
    from variantgen.lang.evaluate import Evaluator

    spec = shipped("mm_prefix")
    qo_len, kv_len = 3, 7
    ranges = torch.tensor([[1, 2], [-1, -1], [0, 6]], dtype=torch.int32)
    args = {"ranges": ranges, "causal_window_left": 2, "range_window_left": -1}
    grid = RequestGrid(0, qo_len, kv_len, 0, 0, 1, 1, torch.device("cpu"))
    dense = mask_for_request(spec, grid, args)[0]
    i, j = (t.flatten() for t in torch.meshgrid(torch.arange(qo_len), torch.arange(kv_len), indexing="ij"))
    q_pos = i + (kv_len - qo_len)
    env = {"q_pos": q_pos, "kv_pos": j, "q_idx": i, "q_row": i, "kv_row": j, "q_kv_row": q_pos,
           "request": torch.zeros_like(i), "qo_len": torch.full_like(i, qo_len), "kv_len": torch.full_like(i, kv_len)}
    rows = Evaluator(spec, env, args).ev(spec.mask)
    assert torch.equal(rows.view(qo_len, kv_len), dense)


def test_the_evaluator_needs_an_environment():
    from variantgen.lang.evaluate import Evaluator

    with pytest.raises(ValueError, match="^Evaluator: env must hold the builtin tensors"):
        Evaluator(shipped("causal"), {}, {})
def _py_bit(x: int, i: int) -> bool:
    """bit(x, i) written out: bit i of x's 32-bit two's complement, false outside 0..31."""
    return 0 <= i < 32 and (x % (1 << 32)) >> i & 1 == 1


BIT_VALUES = [0, 1, -1, 2, 5, -6, 2**31 - 1, -(2**31), 2**30, -(2**30) - 1, 0x55555555, -0x55555556]


def test_bit_on_negative_values_and_out_of_range_indices():
    xs = torch.tensor(BIT_VALUES, dtype=torch.int64).view(-1, 1)
    idx = torch.arange(-40, 41, dtype=torch.int64).view(1, -1)
    got = evaluate.bit(xs, idx)
    for a, x in enumerate(BIT_VALUES):
        for b, i in enumerate(range(-40, 41)):
            assert bool(got[a, b]) == _py_bit(x, i), (x, i)


@settings(max_examples=60, deadline=None, database=None)
@given(st.lists(st.tuples(st.integers(-(2**31), 2**31 - 1), st.integers(-(2**31), 2**31 - 1)), min_size=1,
                max_size=64))
def test_bit_fuzzed_against_python(pairs):
    xs = torch.tensor([x for x, _ in pairs], dtype=torch.int64)
    idx = torch.tensor([i for _, i in pairs], dtype=torch.int64)
    assert evaluate.bit(xs, idx).tolist() == [_py_bit(x, i) for x, i in pairs]


def test_bit_in_a_mask(spec_from):
    """A per-query bitmask ([total_q] words) selects keys by their distance to the query."""
    spec = spec_from("name: a\ntensors:\n  bits: {dtype: int32, shape: [total_q]}\n"
                     "mask: bit(bits[q_row], q_pos - kv_pos) or bit(bits[q_row], kv_pos - 40)\n")
    bits = torch.tensor(BIT_VALUES[:5], dtype=torch.int32)  # one word per query row (3 + 2)
    batch = make_batch()
    for b in range(2):
        got = mask_for_request(spec, batch.grid(b), {"bits": bits})
        for p in batch.positions():
            if p.b == b:
                want = _py_bit(BIT_VALUES[p.q_row], p.q - p.j) or _py_bit(BIT_VALUES[p.q_row], p.j - 40)
                assert bool(got[p.h, p.i, p.j]) == want


def _grid_mask(text: str, qo: int = 4, kv: int = 8) -> torch.Tensor:
    spec = variantgen.parse_spec(text)
    return mask_for_request(spec, RequestGrid(0, qo, kv, 0, 0, 1, 1, torch.device("cpu")), {})[0]


def test_float_min_and_max_skip_a_nan_as_the_kernels_do():
    """max(NaN, 0.0) is 0.0 in the kernels (fmaxf): sqrt of a negative gives NaN for the keys past
    q_pos, and max(..., 0.0) >= 0.0 keeps them visible."""
    assert bool(_grid_mask("name: x\nmask: max(sqrt(float(q_pos - kv_pos)), 0.0) >= 0.0\n").all())
    assert bool(_grid_mask("name: x\nmask: min(log(float(q_pos - kv_pos)), 0.5) <= 0.5\n").all())
    ints = _grid_mask("name: x\nmask: max(q_pos - kv_pos, 0) > 0\n")  # ints: no NaN, as before
    assert ints.tolist() == [[q > k for k in range(8)] for q in range(4, 8)]


def test_minus_zero_is_not_zero():
    """1 / -0.0 is -inf: a constant -0.0 is not the cached +0.0 (0.0 == -0.0 as dict keys)."""
    text = "name: x\nmask: float(kv_pos) >= 0.0 and 1.0 / (-0.0 * float(kv_pos + 1)) < 0.0\n"
    assert bool(_grid_mask(text).all())
