"""variantgen as a Hugging Face transformers attention implementation.

    from variantgen.integrations import transformers as vg_hf

    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="sdpa")
    report = vg_hf.attach(model, backend="flex")  # or "fa2", "fa3", None (make_wrapper's pick)
    print(report)                                  # each route: ok, or why not

``attach`` registers the implementation ``"variantgen"`` in transformers' ``AttentionInterface``
and ``AttentionMaskInterface``, probes the routes (spec, kernel kind) the model's attention calls
map to, makes their wrappers, and switches the model's text layers to ``"variantgen"`` when a
prefill route works. A call no route can serve (its probe said no, dropout, output_attentions,
attention sinks, a non-causal layer, padding inside a sequence, a combination no shipped spec
covers) runs the implementation the model had before, with that implementation's own mask (built
then, and only then); ``report.calls`` counts what ran where.

The mask interface returns a :class:`MaskInfo` (sizes, offsets and the 2D padding mask), never a
dense [q, kv] mask. Each attention call is mapped from what transformers passes:

* each batch row is a request: its keys are the row's unpadded tokens (they must be one run: left
  or right padding), its queries the unpadded query rows, which are the request's last tokens;
* causal layers -> ``causal``; a ``sliding_window`` (the layer's, or the mask's) -> ``sliding_window``
  (window - 1: transformers keeps q - kv < window); a ``softcap`` -> ``softcap``;
* Gemma 3 style image tokens (``token_type_ids == 1`` given to the model's forward; each run of
  image tokens is one bidirectional block) -> ``mm_prefix`` with each image query's block as its
  span (on sliding layers causal_window_left = window - 1 and range_window_left = window, which
  is transformers' AND(window, OR(causal, block)));
* packed documents: position ids that restart inside a row (or ``cu_seq_lens_k``), with no
  padding mask -> ``document`` with each key's document id (FlashAttention's convention in
  transformers: documents do not see each other).

Prefill (several query rows) runs through the ragged kind (or the paged kind over pages of one
token, the default for fa3, whose decode then uses the same module: ``prefill_kind``) on the
batch's unpadded rows; generation steps (one query per
request) through decode, over the model's cache as pages without a copy when no row is
left-padded. The layer's ``scaling`` reaches the kernels as ``q_scale = scaling * sqrt(head_dim)``.
Inference only.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import sys
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from ..lang.library import resolve_spec

log = logging.getLogger("variantgen.transformers")

IMPLEMENTATION = "variantgen"
SESSION_ATTR = "_variantgen_session"
_tokens = itertools.count()


@functools.cache
def _shipped(name: str):
    """A shipped spec by name (library.py: the package's specs, in a checkout or a wheel)."""
    return resolve_spec(name)


# ----------------------------------------------------------------------------- registration


def register() -> None:
    """Add ``"variantgen"`` to transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, mask_interface)


@dataclass(eq=False)
class MaskInfo:
    """What the mask interface hands each layer instead of a dense mask: the sizes transformers
    computed, the 2D padding mask, and (for the fallback) the call that would build its own
    mask. One object per mask per forward; the layers using it share its plans."""

    batch_size: int
    q_length: int
    kv_length: int
    q_offset: int
    kv_offset: int
    padding: torch.Tensor | None  # bool [batch, >= kv_offset + kv_length], True = a real token
    local_size: int | None  # the sliding window create_sliding_window_causal_mask passed
    mask_kwargs: dict[str, Any]
    token: int = field(default_factory=lambda: next(_tokens))
    cache: dict[Any, Any] = field(default_factory=dict)  # prepared batches, per route

    def fallback_mask(self, implementation: str):
        """The mask ``implementation`` builds for this call (cached)."""
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        key = ("mask", implementation)
        if key not in self.cache:
            self.cache[key] = ALL_MASK_ATTENTION_FUNCTIONS[implementation](**self.mask_kwargs)
        return self.cache[key]


def mask_interface(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0, kv_offset: Any = 0,
                   attention_mask: torch.Tensor | None = None, **kwargs: Any) -> MaskInfo:
    """transformers' mask-interface call for ``"variantgen"``: no mask is built."""
    full = dict(kwargs, batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                kv_offset=kv_offset, attention_mask=attention_mask)
    padding = None
    if attention_mask is not None and not bool(attention_mask.all()):
        padding = attention_mask.to(torch.bool)
    return MaskInfo(batch_size, q_length, kv_length, int(q_offset), int(kv_offset), padding,
                    kwargs.get("local_size"), full)


# ----------------------------------------------------------------------------- routes


@dataclass(frozen=True)
class Call:
    """One attention call mapped to a route: the spec, the kind, the scalars, the batch."""

    spec_name: str
    kind: str  # "prefill" / "ragged" (several query rows) or "decode"
    scalars: tuple[tuple[str, Any], ...]
    prepared: Prepared


@dataclass(frozen=True)
class Prepared:
    """A forward's batch as the wrappers take it (shared by the layers that use one mask)."""

    q_b: torch.Tensor  # the (batch row, query row) of every query, on the device
    q_i: torch.Tensor
    kv_b: torch.Tensor  # the (batch row, key index) of every key
    kv_j: torch.Tensor
    qo_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    kv_first: tuple[int, ...]  # each request's first key index in the layer's key tensor
    tensors: dict[str, torch.Tensor]  # spec tensors (ranges / doc_ids), empty for scalar specs


@dataclass
class Route:
    """A (spec, kind) the model's calls map to: its wrappers (one per set of scalars, so that
    layers using two masks of one spec, e.g. Gemma 3's global and local image layers, do not
    plan again at every switch), or why it is off."""

    spec_name: str
    kind: str
    backend: str | None
    make: Any = None  # () -> a new wrapper
    spare: Any = None  # the wrapper attach() made (it serves the first set of scalars)
    wrappers: dict[tuple, Any] = field(default_factory=dict)
    planned_for: dict[tuple, tuple[int, int]] = field(default_factory=dict)  # (MaskInfo token, key length)
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.make is not None

    def wrapper(self, scalars: tuple) -> Any:
        if scalars not in self.wrappers:
            self.wrappers[scalars] = self.spare if self.spare is not None else self.make()
            self.spare = None
        return self.wrappers[scalars]


@dataclass
class AttachReport:
    """What attach() decided: ``ok`` when the model now runs "variantgen" (some prefill route
    works); each route with its wrapper's backend or why not; ``calls`` counts the calls each
    route served and each reason a call went to ``fallback`` (updated as the model runs)."""

    ok: bool
    backend: str | None
    fallback: str
    routes: dict[tuple[str, str], str]
    calls: Counter = field(default_factory=Counter)

    def __str__(self) -> str:
        head = (f"variantgen attention ({self.backend or 'auto'}): "
                + ("on" if self.ok else f"off, the model keeps {self.fallback}") + f"; fallback {self.fallback}")
        lines = [head] + [f"  {spec:15s} {kind:8s} {status}" for (spec, kind), status in sorted(self.routes.items())]
        return "\n".join(lines)


class Session:
    """A model's routes and the inputs of its current forward (attached to its attention layers)."""

    def __init__(self, model: Any, backend: str | None, prefill_kind: str, fallback: str, device: torch.device,
                 dtype: torch.dtype, head_dim: int, num_qo_heads: int, num_kv_heads: int):
        self.model = weakref.ref(model)
        self.backend = backend
        self.prefill_kind = prefill_kind
        self.fallback = fallback
        self.device = device
        self.dtype = dtype
        self.head_dim = head_dim
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.routes: dict[tuple[str, str], Route] = {}
        self.inputs: dict[str, Any] = {}
        self.report: AttachReport | None = None
        self.hooks: list[Any] = []
        self._workspace: torch.Tensor | None = None

    def workspace(self) -> torch.Tensor:
        if self._workspace is None:
            size = 128 << 20 if self.device.type == "cuda" else 0
            self._workspace = torch.empty(size, dtype=torch.uint8, device=self.device)
        return self._workspace

    def kind_backend(self, kind: str) -> str | None:
        """The backend of a kind: the one asked for (fa3's decode runs its paged prefill module,
        the module its prefill uses)."""
        return self.backend

    def add_route(self, spec_name: str, kind: str) -> Route:
        """Probe the route and make its wrapper (or keep the reason)."""
        from ..api.factory import make_wrapper
        from ..api.probing import probe

        backend = self.kind_backend(kind)
        route = Route(spec_name, kind, backend)
        spec = _shipped(spec_name)
        dtype = str(self.dtype).removeprefix("torch.")
        self.routes[(spec_name, kind)] = route
        if backend != "flex" and self.device.type != "cuda":
            route.reason = (f"the model is on {self.device}; the {backend or 'FlashInfer'} routes run on CUDA GPUs "
                            "(backend='flex' runs here)")
        else:
            result = probe(spec, head_dim_qk=self.head_dim, q_dtype=dtype, kv_dtype=dtype,
                                      backend=backend, kind=kind, device=self.device)
            route.reason = result.reason
        if not route.reason:
            def make() -> Any:
                return make_wrapper(spec, self.workspace(), head_dim_qk=self.head_dim, q_dtype=dtype, kv_dtype=dtype,
                                    backend=backend, kind=kind, kv_layout="HND" if kind == "decode" else "NHD")

            try:
                route.spare = make()
                route.make = make
            except Exception as e:  # noqa: BLE001 - the route is off, with the reason
                route.reason = f"{type(e).__name__}: {e}"
        if self.report is not None:
            self.report.routes[(spec_name, kind)] = _route_status(route)
        return route


def _route_status(route: Route) -> str:
    if not route.ok:
        return f"no: {route.reason}"
    return f"ok ({route.backend or (route.spare or next(iter(route.wrappers.values()))).config.backend})"


# ----------------------------------------------------------------------------- attach


def attach(model: Any, *, backend: str | None = "flex", prefill_kind: str | None = None,
           documents: bool = True) -> AttachReport:
    """Serve ``model``'s text attention with variantgen where a route works (see the module doc).

    ``backend``: "flex" (torch's FlexAttention: any device torch runs it on), "fa2", "fa3"
    (sm90; its decode runs the prefill module), or None (what make_wrapper picks for each kind).
    ``prefill_kind``: "ragged" or "prefill" (paged, pages of one token); default "prefill" for
    fa3 / None, else "ragged". ``documents``: also probe the document route (packed sequences).
    Probes run here (for the FlashInfer routes they may build modules). Returns the report; the
    model is switched only when ``report.ok``."""
    register()
    if prefill_kind is None:
        prefill_kind = "prefill" if backend in (None, "fa3") else "ragged"
    if prefill_kind not in ("prefill", "ragged"):
        raise ValueError(f"prefill_kind={prefill_kind!r}: expected 'prefill' or 'ragged'")
    if backend not in (None, "fa2", "fa3", "flex"):
        raise ValueError(f"backend={backend!r}: expected 'flex', 'fa2', 'fa3' or None")
    detach(model)
    tc = model.config.get_text_config()
    fallback = tc._attn_implementation or "sdpa"
    if fallback == IMPLEMENTATION:
        fallback = "sdpa"
    param = next(model.parameters())
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    session = Session(model, backend, prefill_kind, fallback, param.device, param.dtype, head_dim,
                      tc.num_attention_heads, tc.num_key_value_heads or tc.num_attention_heads)
    session.report = AttachReport(False, backend, fallback, {})
    for spec_name in candidate_specs(model, documents):
        for kind in (prefill_kind, "decode"):
            if spec_name in ("mm_prefix", "document") and kind == "decode":
                continue  # a generation step's one query is text: causal / sliding / softcap routes serve it
            session.add_route(spec_name, kind)
    ok = any(r.ok and r.kind == prefill_kind for r in session.routes.values())
    session.report.ok = ok
    if not ok:
        log.warning("variantgen: no prefill route works; %s keeps %s\n%s", type(model).__name__, fallback,
                    session.report)
        return session.report
    for module in model.modules():
        setattr(module, SESSION_ATTR, session)
    if "text_config" in getattr(model.config, "sub_configs", {}):
        model.set_attn_implementation({"text_config": IMPLEMENTATION})
    else:
        model.set_attn_implementation(IMPLEMENTATION)
    session.hooks = [model.register_forward_pre_hook(_capture_inputs, with_kwargs=True),
                     model.register_forward_hook(_forget_inputs, always_call=True)]
    log.info("%s", session.report)
    return session.report


def detach(model: Any) -> None:
    """Undo attach(): the model's previous implementation, no hook, no session."""
    session = getattr(model, SESSION_ATTR, None)
    if session is None:
        return
    for hook in session.hooks:
        hook.remove()
    if "text_config" in getattr(model.config, "sub_configs", {}):
        model.set_attn_implementation({"text_config": session.fallback})
    else:
        model.set_attn_implementation(session.fallback)
    for module in model.modules():
        if getattr(module, SESSION_ATTR, None) is session:
            delattr(module, SESSION_ATTR)


def candidate_specs(model: Any, documents: bool) -> list[str]:
    """The shipped specs the model's attention calls can map to."""
    tc = model.config.get_text_config()
    types = set(getattr(tc, "layer_types", None) or
                (["sliding_attention"] if getattr(tc, "sliding_window", None) else ["full_attention"]))
    softcap = getattr(tc, "attn_logit_softcapping", None)
    out = []
    if softcap:
        out.append("softcap")
    else:
        if "full_attention" in types:
            out.append("causal")
        if "sliding_attention" in types:
            out.append("sliding_window")
        if _is_multimodal(model):
            out.append("mm_prefix")
        if documents and "sliding_attention" not in types:
            out.append("document")
    return out


def _is_multimodal(model: Any) -> bool:
    return getattr(model.config, "vision_config", None) is not None and hasattr(model, "get_image_features")


def _capture_inputs(module: Any, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: the inputs the masks depend on that transformers does not pass to
    attention (token_type_ids)."""
    session = getattr(module, SESSION_ATTR, None)
    if session is not None:
        session.inputs = {"token_type_ids": kwargs.get("token_type_ids")}


def _forget_inputs(module: Any, args: tuple, output: Any) -> None:
    """Forward hook (also on errors): a later call of an inner module alone must not see this
    forward's inputs."""
    session = getattr(module, SESSION_ATTR, None)
    if session is not None:
        session.inputs = {}


# ----------------------------------------------------------------------------- the attention call


def attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any, dropout: float = 0.0, scaling: float | None = None, **kwargs: Any):
    """The ``"variantgen"`` attention function: (attn_output [batch, q_len, heads, head_dim], None)."""
    session: Session | None = getattr(module, SESSION_ATTR, None)
    if session is None:
        raise RuntimeError("attention implementation 'variantgen' is used by a model variantgen was not attached to: "
                           "call variantgen.integrations.transformers.attach(model, backend=...)")
    mapped = _map_call(session, module, query, key, attention_mask, dropout, kwargs)
    if isinstance(mapped, str):
        return _fallback(session, mapped, module, query, key, value, attention_mask, dropout, scaling, kwargs)
    route = session.routes.get((mapped.spec_name, mapped.kind))
    if route is None or not route.ok:
        reason = f"route {mapped.spec_name}/{mapped.kind} is off"
        return _fallback(session, reason, module, query, key, value, attention_mask, dropout, scaling, kwargs)
    session.report.calls[f"{mapped.spec_name}/{mapped.kind}"] += 1
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    return _run(route, mapped, attention_mask, query, key, value, scale * math.sqrt(query.shape[-1])), None


def _fallback(session: Session, reason: str, module: Any, query, key, value, attention_mask, dropout, scaling,
              kwargs):
    from transformers import AttentionInterface

    session.report.calls[f"fallback: {reason}"] += 1
    if session.report.calls[f"fallback: {reason}"] == 1:
        log.info("variantgen: %s runs %s (%s)", type(module).__name__, session.fallback, reason)
    mask = attention_mask.fallback_mask(session.fallback) if isinstance(attention_mask, MaskInfo) else attention_mask
    if session.fallback == "eager":
        fn = sys.modules[type(module).__module__].eager_attention_forward  # the model's own
    else:
        fn = AttentionInterface()[session.fallback]
    return fn(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)


def _map_call(session: Session, module: Any, query: torch.Tensor, key: torch.Tensor, mask: Any, dropout: float,
              kwargs: dict[str, Any]) -> Call | str:
    """The call's route, or why it has none."""
    if not isinstance(mask, MaskInfo):
        return "the attention mask was not made by variantgen's mask interface"
    if dropout:
        return f"dropout={dropout}"
    if kwargs.get("output_attentions"):
        return "output_attentions=True"
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        return "attention sinks"
    if not getattr(module, "is_causal", True):
        return "a non-causal layer"
    if key.shape[2] != mask.kv_length or query.shape[2] != mask.q_length:
        return f"key/query lengths {key.shape[2]}/{query.shape[2]} differ from the mask's {mask.kv_length}/" \
               f"{mask.q_length}"
    window = kwargs.get("sliding_window") or mask.local_size
    softcap = kwargs.get("softcap")
    prepared = _prepare(mask, session, kwargs)
    if isinstance(prepared, str):
        return prepared
    decode = mask.q_length == 1 and all(n == 1 for n in prepared.qo_lens)
    kind = "decode" if decode else session.prefill_kind
    if "ranges" in prepared.tensors:
        if softcap:
            return "image tokens with a logits soft-cap (no shipped spec has both)"
        scalars = (("causal_window_left", window - 1 if window else -1), ("range_window_left", window or -1))
        return Call("mm_prefix", kind, scalars, prepared)
    if "doc_ids" in prepared.tensors:
        if window or softcap:
            return "packed documents with a sliding window or soft-cap (no shipped spec has both)"
        return Call("document", kind, (), prepared)
    if softcap:
        return Call("softcap", kind, (("soft_cap", float(softcap)), ("window", window - 1 if window else -1)),
                    prepared)
    if window:
        return Call("sliding_window", kind, (("window", window - 1),), prepared)
    return Call("causal", kind, (), prepared)


def _prepare(mask: MaskInfo, session: Session, kwargs: dict[str, Any]) -> Prepared | str:
    """The requests of a mask's batch (cached on the mask: the layers using it share them; the
    position ids and cu_seq_lens_k they get are the same tensors)."""
    pos, cu = kwargs.get("position_ids"), kwargs.get("cu_seq_lens_k")
    key = ("prepared", id(pos), id(cu))
    if key not in mask.cache:
        mask.cache[key] = (_prepare_uncached(mask, session, _document_ids(mask, pos, cu)), pos, cu)  # keep ids alive
    return mask.cache[key][0]


def _document_ids(mask: MaskInfo, pos: torch.Tensor | None, cu: torch.Tensor | None) -> torch.Tensor | None:
    """int32 [batch, kv_length] document ids where a row holds packed documents, else None."""
    if mask.padding is not None or mask.q_offset != 0 or mask.kv_offset != 0 or mask.q_length != mask.kv_length:
        return None
    if cu is not None and mask.batch_size == 1:
        bounds = torch.zeros(mask.kv_length, dtype=torch.int32, device=cu.device)
        inner = cu[1:-1].long()
        bounds[inner[inner < mask.kv_length]] = 1
        ids = bounds.cumsum(0, dtype=torch.int32)[None]
    else:
        if pos is None or pos.shape[-1] != mask.kv_length:
            return None
        pos = pos.expand(mask.batch_size, -1)
        diff = torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1)
        ids = (diff != 1).cumsum(-1).to(torch.int32)
    return ids if bool((ids[:, -1] > ids[:, 0]).any()) else None


def _prepare_uncached(mask: MaskInfo, session: Session, docs: torch.Tensor | None) -> Prepared | str:
    dev = session.device
    batch, q_len, kv_len = mask.batch_size, mask.q_length, mask.kv_length
    if mask.padding is None:
        first, count = [0] * batch, [kv_len] * batch
    else:
        pad = mask.padding[:, mask.kv_offset:mask.kv_offset + kv_len].to(dev)
        if pad.shape[1] < kv_len:  # a static cache longer than the mask: the rest is padding
            pad = torch.nn.functional.pad(pad, (0, kv_len - pad.shape[1]))
        idx = torch.arange(kv_len, device=dev)
        cnt = pad.sum(1)
        start = torch.where(cnt > 0, torch.where(pad, idx, kv_len).amin(1), 0)
        run = (idx >= start[:, None]) & (idx < (start + cnt)[:, None])
        if not torch.equal(run, pad):
            return "padding inside a sequence (each row's real tokens must be one run)"
        first, count = start.tolist(), cnt.tolist()
    q0 = mask.q_offset - mask.kv_offset  # key index of query row 0
    qo_lens, kv_lens, q_first = [], [], []
    for b in range(batch):
        end = first[b] + count[b]
        if count[b] and end > q0 + q_len:
            return "keys after the last query (the queries must be each request's last tokens)"
        lo = max(first[b], q0)
        qo_lens.append(max(0, end - lo))
        q_first.append(lo - q0)
        kv_lens.append(count[b])
    q_b = [b for b in range(batch) for _ in range(qo_lens[b])]
    q_i = [q_first[b] + i for b in range(batch) for i in range(qo_lens[b])]
    kv_b = [b for b in range(batch) for _ in range(kv_lens[b])]
    kv_j = [first[b] + j for b in range(batch) for j in range(kv_lens[b])]
    as_dev = lambda v: torch.tensor(v, dtype=torch.long, device=dev)  # noqa: E731
    tensors: dict[str, torch.Tensor] = {}
    blocks = _image_blocks(mask, session)
    if isinstance(blocks, str):
        return blocks
    if blocks is not None:
        if docs is not None:
            return "image tokens in packed documents (no shipped spec has both)"
        # each image query sees its block [start, end] (request-local positions); text queries none
        starts, ends = blocks
        qb, qi = as_dev(q_b), as_dev(q_i)
        shift = as_dev(first)[qb]
        s, e = starts[qb, qi], ends[qb, qi]
        inside = s >= 0
        ranges = torch.stack([torch.where(inside, s - shift, -1), torch.where(inside, e - shift, -1)], 1)
        tensors["ranges"] = ranges.to(torch.int32).contiguous()
    if docs is not None:
        tensors["doc_ids"] = docs.to(dev)[as_dev(kv_b), as_dev(kv_j)].to(torch.int32).contiguous()
    return Prepared(as_dev(q_b), as_dev(q_i), as_dev(kv_b), as_dev(kv_j), tuple(qo_lens), tuple(kv_lens),
                    tuple(first), tensors)


def _image_blocks(mask: MaskInfo, session: Session) -> tuple[torch.Tensor, torch.Tensor] | None | str:
    """Per (batch row, query row), the key-index span [start, end] of the image block the query
    is in (-1 for text), from the forward's token_type_ids; None without image tokens."""
    tt = session.inputs.get("token_type_ids")
    if tt is None or mask.q_length < 2:
        return None
    is_image = (tt == 1).to(session.device)
    if not bool(is_image.any()):
        return None
    if mask.q_offset != 0 or mask.kv_offset != 0 or is_image.shape[1] != mask.q_length:
        return "image tokens in a forward that continues a cache (their blocks are only known from position 0)"
    n = is_image.shape[1]
    idx = torch.arange(n, device=session.device).expand_as(is_image)
    prev = torch.nn.functional.pad(is_image, (1, 0))[:, :-1]
    nxt = torch.nn.functional.pad(is_image, (0, 1))[:, 1:]
    start_at = torch.where(is_image & ~prev, idx, -1).cummax(1).values
    end_at = torch.where(is_image & ~nxt, idx, n).flip(1).cummin(1).values.flip(1)
    starts = torch.where(is_image, start_at, -1)
    ends = torch.where(is_image, end_at, -1)
    return starts, ends


def _run(route: Route, call: Call, mask: MaskInfo, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
         q_scale: float) -> torch.Tensor:
    """The call through its route's wrapper: [batch, q_len, heads, head_dim_vo] (rows without a
    query of a request are zeros)."""
    w, p = route.wrapper(call.scalars), call.prepared
    dev = query.device
    args = dict(p.tensors, **dict(call.scalars))
    i32 = dict(dtype=torch.int32, device=dev)
    heads, hkv = query.shape[1], key.shape[1]
    planned = (mask.token, key.shape[2])
    fresh = route.planned_for.get(call.scalars) != planned
    route.planned_for[call.scalars] = planned
    if route.kind == "decode":
        q = query[:, :, 0]
        if all(f == 0 for f in p.kv_first):  # the cache as it is: one page per request, HND
            cache = (key, value)
            ps = key.shape[2]
            indptr = torch.arange(len(p.kv_lens) + 1, **i32)
            indices = torch.arange(len(p.kv_lens), **i32)
            last = torch.tensor(p.kv_lens, **i32)
        else:  # left padding: the keys copied into pages of one token
            cache = tuple(t.transpose(1, 2)[p.kv_b, p.kv_j].unsqueeze(2) for t in (key, value))
            ps = 1
            indptr = torch.tensor([0, *itertools.accumulate(p.kv_lens)], **i32)
            indices = torch.arange(int(indptr[-1]), **i32)
            last = torch.ones(len(p.kv_lens), **i32)
        if fresh:
            w.plan(indptr, indices, last, heads, hkv, ps, **_plan_args(w, args))
        out = w.run(q, cache, q_scale=q_scale, **args)
        return out.unsqueeze(1)
    qp = query.transpose(1, 2)[p.q_b, p.q_i]
    kp = key.transpose(1, 2)[p.kv_b, p.kv_j]
    vp = value.transpose(1, 2)[p.kv_b, p.kv_j]
    qo_indptr = torch.tensor([0, *itertools.accumulate(p.qo_lens)], **i32)
    kv_indptr = torch.tensor([0, *itertools.accumulate(p.kv_lens)], **i32)
    if route.kind == "ragged":
        if fresh:
            w.plan(qo_indptr, kv_indptr, heads, hkv, **_plan_args(w, args))
        out = w.run(qp, kp, vp, q_scale=q_scale, **args)
    else:  # paged prefill over pages of one token
        if fresh:
            w.plan(qo_indptr, kv_indptr, torch.arange(int(kv_indptr[-1]), **i32),
                   torch.ones(len(p.kv_lens), **i32), heads, hkv, 1, **_plan_args(w, args))
        out = w.run(qp, (kp.unsqueeze(1), vp.unsqueeze(1)), q_scale=q_scale, **args)
    result = query.new_zeros(query.shape[0], query.shape[2], heads, out.shape[-1])
    result[p.q_b, p.q_i] = out.to(result.dtype)
    return result


def _plan_args(wrapper: Any, args: dict[str, Any]) -> dict[str, Any]:
    """The spec arguments plan() takes (what the key intervals read), where it plans with them."""
    form = getattr(wrapper, "_interval_facts", None)
    if form is None or not form.form.planner_ready:
        return {}
    return {k: v for k, v in args.items() if k in form.args}
