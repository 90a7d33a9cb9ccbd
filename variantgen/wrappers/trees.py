"""Draft trees of speculative decoding -> the ancestor bitmask ``tree_bits`` of specs/tree_verify.yaml.

A verification step scores a tree of draft tokens per request (EAGLE, Medusa, SpecInfer): the
request's ``qo_len`` draft nodes are its last keys, node ``k`` at position
``kv_len - qo_len + k``, in topological order (a node's parent comes before it). Each node sees
the whole cached context, its ancestors and itself. The spec takes the tree as one row per
query, ``tree_bits[total_q, TREE_WORDS]`` int32: bit ``j % 32`` of word ``j // 32`` of node
``k``'s row is set when node ``j`` is ``k`` or one of its ancestors. A serving engine knows each
node's parent; :func:`tree_bits` turns parent lists into that tensor::

    bits = variantgen.tree_bits([[-1, 0, 0, 1], [-1, 0]], device="cuda")  # two requests' trees
    wrapper.plan(..., tree_bits=bits)
    wrapper.run(q, kv_cache, tree_bits=bits)

A chain (each node the child of the one before) is plain causal attention over the drafts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..lang.spec import MAX_FIXED_DIM
from .checks import to_device

TREE_WORDS = 2  # int32 words per node row in specs/tree_verify.yaml
MAX_TREE_NODES = 32 * TREE_WORDS  # draft nodes per request the spec can describe


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def tree_bits(parents: Sequence[Sequence[int]], *, words: int = TREE_WORDS,
              device: str | torch.device | None = None) -> torch.Tensor:
    """int32 ``[sum(len(p) for p in parents), words]``: per draft node, the bitmask of itself and
    its ancestors (bit j % 32 of word j // 32 for node j), requests back to back in the order of q.

    ``parents[i][k]`` is the parent of request ``i``'s node ``k``: a node before it
    (``0 <= parents[i][k] < k``), or ``-1`` for a node whose parent is the cached context (the
    tree's root; a request may have several). A request has at most ``32 * words`` nodes (64 for
    specs/tree_verify.yaml). Raises ValueError naming the offending request and node."""
    if not _whole(words) or not 1 <= words <= MAX_FIXED_DIM:
        raise ValueError(f"tree_bits: words={words!r}: expected a positive int of at most {MAX_FIXED_DIM} (a spec "
                         "tensor's fixed dimension)")
    if not isinstance(parents, Sequence) or isinstance(parents, (str, bytes)):
        raise ValueError(f"tree_bits: parents: expected a list with one list of parent indices per request, got "
                         f"{type(parents).__name__}")
    rows: list[list[int]] = []
    for i, nodes in enumerate(parents):
        if isinstance(nodes, torch.Tensor) and nodes.dim() == 1 and not nodes.dtype.is_floating_point:
            nodes = nodes.tolist()  # (an engine's parent indices)
        if not isinstance(nodes, Sequence) or isinstance(nodes, (str, bytes)):
            raise ValueError(f"tree_bits: parents[{i}]: expected a list of parent indices, got {type(nodes).__name__}")
        if len(nodes) > 32 * words:
            raise ValueError(f"tree_bits: request {i} has {len(nodes)} draft nodes; {words} word(s) per row hold "
                             f"at most {32 * words}")
        masks: list[int] = []
        for k, parent in enumerate(nodes):
            if not _whole(parent) or not -1 <= parent < k:
                earlier = f"or an earlier node 0..{k - 1}" if k else "(node 0 has no earlier node)"
                raise ValueError(f"tree_bits: parents[{i}][{k}]={parent!r}: expected -1 (a root) {earlier} (nodes "
                                 "are in topological order)")
            masks.append((masks[parent] if parent >= 0 else 0) | (1 << k))
        for m in masks:
            # each word as the int32 the kernel reads (two's complement: bit 31 makes it negative)
            rows.append([(m >> (32 * w) & 0xFFFFFFFF) - ((m >> (32 * w + 31) & 1) << 32) for w in range(words)])
    out = torch.tensor(rows, dtype=torch.int32) if rows else torch.empty(0, words, dtype=torch.int32)
    return to_device("tree_bits", out, device)


def random_tree_parents(num_nodes: int, generator: torch.Generator, shape: str = "random") -> list[int]:
    """Parent indices of a draft tree of ``num_nodes`` nodes for tests and benchmarks: ``chain``
    (a single path), ``star`` (every node a child of node 0), ``forest`` (random parents or
    roots), ``random`` (random earlier parents under one root)."""
    if shape == "chain":
        return [k - 1 for k in range(num_nodes)]
    if shape == "star":
        return [-1] + [0] * (num_nodes - 1) if num_nodes else []
    if shape not in ("random", "forest"):
        raise ValueError(f"random_tree_parents: shape={shape!r}: expected chain, star, forest or random")
    low = -1 if shape == "forest" else 0
    return [int(torch.randint(low, k, (1,), generator=generator)) if k else -1 for k in range(num_nodes)]
