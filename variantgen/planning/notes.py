"""What ``variantgen validate`` says about a mask's plan: where the interval planner cannot bound
it (planner off, or a key comparison kept as a hull), what the planner needs, and an equivalent
form it would plan where one exists (a divisor that only lacks a declared sign)."""

from __future__ import annotations

from dataclasses import dataclass

from ..lang.nodes import Node, names_used, to_source
from ..lang.reads import KEY_NAMES, atoms
from ..lang.values import VariantSpec
from .intervals import _atom, analyze
from .normalize import Rewriter, normalize, positive_scalars


@dataclass(frozen=True)
class PlannerNote:
    message: str
    hint: str = ""


def planner_notes(spec: VariantSpec) -> list[PlannerNote]:
    """What ``variantgen validate`` tells the author about the mask's plan: nothing where the
    planner bounds every row exactly; otherwise what it cannot bound, what it needs, and an
    equivalent form it would plan where one exists."""
    form = analyze(spec)
    scalars = {s.name: s for s in spec.scalars}
    guards: list[Node] = []
    assumed = Rewriter(positive_scalars(spec), assume_positive=True, guards=guards).boolean(spec.mask)
    divisors = sorted({to_source(g) for g in guards})
    unknown = [d for d in divisors if d in scalars]
    declare = (f"declare {' and '.join(f'`{d}`' for d in unknown)} `positive: true` (or `min: 1`) under scalars"
               if unknown else "")
    notes: list[PlannerNote] = []
    if not form.planner_ready:
        hint = ("the planner needs every comparison that reads kv_pos to be linear in it (kv_pos <= q_pos + w), "
                "kv_pos // c == r, or t[kv_row] == v on a sorted [total_kv] tensor, joined by and / or")
        if declare:
            hint = f"{declare}: the planner then plans it as {to_source(assumed)}"
        notes.append(PlannerNote(f"the interval planner is off for this mask ({form.reason}): every row evaluates "
                                 "the mask on every key", hint))
        return notes
    key_tensors = frozenset(t.name for t in spec.tensors if t.shape == ("total_kv",))
    unbounded, key_sets, by_blocks = [], [], []
    for atom in atoms(normalize(spec.mask, spec)):
        if names_used(atom) & KEY_NAMES:
            term = _atom(atom, key_tensors)
            if term.key_set:
                key_sets.append(to_source(atom))
            elif term.row_blocked:
                by_blocks.append(to_source(atom))
            elif not term.exact:
                unbounded.append(to_source(atom))
    if unbounded:
        shown = ", ".join(f"`{a}`" for a in dict.fromkeys(unbounded))
        hint = declare or ("rows that read the key only through linear comparisons (kv_pos <= q_pos + w), or "
                           "through a test of the key alone (is_global[kv_row] != 0, kv_pos % b >= b - c), or "
                           "the query only by blocks (bit(picks[q_pos // b], kv_pos // b)), plan exactly or by "
                           "pages; one that reads the key and the query's position together is evaluated over "
                           "the rows' key hull")
        notes.append(PlannerNote(f"the planner cannot bound {shown}: rows where it decides evaluate the mask over "
                                 "their key hull", hint))
    if key_sets:
        shown = ", ".join(f"`{a}`" for a in dict.fromkeys(key_sets))
        notes.append(PlannerNote(f"{shown} tests the key alone: rows where it decides read only the pages that hold "
                                 "such a key (page lists; the hull in CUDA-graph mode), evaluating the mask there",
                                 "variantgen explain shows the pages read against the keys visible"))
    if by_blocks:
        shown = ", ".join(f"`{a}`" for a in dict.fromkeys(by_blocks))
        notes.append(PlannerNote(f"{shown} reads the query by blocks: rows where it decides read only the pages "
                                 "where some block of their run sees a key (page lists; the hull in CUDA-graph "
                                 "mode), evaluating the mask there",
                                 declare or "variantgen explain shows the pages read against the keys visible"))
    return notes
