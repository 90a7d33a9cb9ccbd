"""The package surface: `import variantgen` stays light (no torch), help() shows the real
signatures and docstrings, and the public helpers check their arguments."""

from __future__ import annotations

import importlib
import inspect
import pydoc
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import variantgen

REPO = Path(__file__).resolve().parents[2]


def test_import_does_not_import_torch():
    code = ("import sys, variantgen, variantgen.api.probing, variantgen.api.factory, variantgen.routing.capabilities; "
            "print('torch' in sys.modules, callable(variantgen.probe), variantgen.probe.__module__, "
            "variantgen.make_wrapper.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}).stdout.split()
    assert out == ["False", "True", "variantgen.api.probing", "variantgen.api.factory"]


@pytest.mark.parametrize("name, params", [
    ("probe", ["spec", "head_dim_qk", "q_dtype", "kv_dtype", "runtime"]),
    ("probe_backends", ["spec", "kinds", "backends"]),
    ("make_wrapper", ["spec", "workspace", "head_dim_qk", "q_dtype", "kv_dtype", "backend", "graph"]),
    ("choose_backend", ["spec", "kind", "arch"]),
    ("spans_to_ranges", ["qo_lens", "kv_lens", "spans", "device"]),
    ("tree_bits", ["parents", "words", "device"]),
])
def test_help_shows_the_real_signature_and_docstring(name, params):
    fn = getattr(variantgen, name)
    assert inspect.isfunction(fn)
    signature = inspect.signature(fn)
    assert all(p in signature.parameters for p in params), signature
    text = pydoc.render_doc(fn, renderer=pydoc.plaintext)
    assert f"function {name} in module variantgen." in text
    assert fn.__doc__ and fn.__doc__.split("\n")[0].strip() in text


def test_probe_is_only_the_function():
    """The module is variantgen.api.probing: no import can rebind `variantgen.probe` to a module of
    the same name, and nothing patches the package to keep it the function."""
    module = importlib.import_module("variantgen.api.probing")
    assert variantgen.probe is module.probe and variantgen.probe.cache_clear is module.cache_clear
    package = Path(variantgen.__file__).parent
    assert not (package / "probe.py").exists() and not (package / "probe").exists()


def test_dir_and_all_name_the_lazy_functions():
    for name in ("GraphCapacity", "spans_to_ranges", "tree_bits"):
        assert name in dir(variantgen) and name in variantgen.__all__
    assert all(hasattr(variantgen, name) for name in variantgen.__all__)
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        variantgen.nope  # noqa: B018


# ----------------------------------------------------------------------------- spans_to_ranges


def test_spans_to_ranges_marks_each_query_of_a_span():
    # request 0: 6 queries at positions 0..5; request 1: chunked prefill, queries at 7..9
    ranges = variantgen.spans_to_ranges([6, 3], [6, 10], [[(1, 2), (4, 5)], [(6, 8)]])
    assert ranges.dtype == torch.int32 and ranges.shape == (9, 2)
    assert ranges.tolist() == [[-1, -1], [1, 2], [1, 2], [-1, -1], [4, 5], [4, 5],
                               [6, 8], [6, 8], [-1, -1]]
    assert variantgen.spans_to_ranges([], [], []).shape == (0, 2)
    assert variantgen.spans_to_ranges([2], [2], [[]]).tolist() == [[-1, -1], [-1, -1]]
    assert variantgen.spans_to_ranges([1], [1], [[(0, 0)]], device="cpu").tolist() == [[0, 0]]


def test_spans_to_ranges_agrees_with_the_reference_mask():
    """The spans it builds give the mm_prefix mask FlashInfer's ranges wrapper computes."""
    from variantgen.wrappers.reference import RequestGrid, mask_for_request

    spec = variantgen.load_spec(REPO / "specs" / "mm_prefix.yaml")
    ranges = variantgen.spans_to_ranges([4], [8], [[(2, 6)]])
    grid = RequestGrid(0, 4, 8, 0, 0, 1, 1, torch.device("cpu"))
    mask = mask_for_request(spec, grid, {"ranges": ranges, "causal_window_left": -1, "range_window_left": -1})
    visible = mask.reshape(4, 8)
    # queries at positions 4..7: 4, 5, 6 lie in the span (keys 2..6 and causal); 7 is causal only
    assert visible[0].tolist() == [True] * 7 + [False]
    assert visible[3].tolist() == [True] * 8


@pytest.mark.parametrize("args, message", [
    (([1, 2], [1], [[], []]), "one entry per request (got 2, 1 and 2)"),
    (([3], [2], [[]]), "qo_lens[0]=3, kv_lens[0]=2: expected whole numbers with 0 <= qo_len <= kv_len"),
    (([1.0], [2], [[]]), "qo_lens[0]=1.0"),
    (([2], [5], [[(1, 5)]]), "spans[0][0]=(1, 5): expected 0 <= start <= end < kv_lens[0]=5"),
    (([2], [5], [[(3, 2)]]), "spans[0][0]=(3, 2): expected 0 <= start <= end"),
    (([2], [5], [[(-1, 2)]]), "spans[0][0]=(-1, 2)"),
    (([2], [5], [[(1, 2, 3)]]), "spans[0][0]=(1, 2, 3): expected a pair of whole numbers"),
    (([2], [5], [[(True, 2)]]), "expected a pair of whole numbers"),
    (([2], [5], [[5]]), "spans[0][0]=5: expected a pair"),
    (([2, 2], [5, 9], [[], [(4, 6), (0, 1), (6, 8)]]), "spans[1][0]=(4, 6) and spans[1][2]=(6, 8) overlap"),
    (([2], [5], None), "spans=None: expected a sequence with one entry per request"),
    ((None, [5], [[]]), "qo_lens=None: expected a sequence"),
    (([2], [5], [None]), "spans[0]=None: expected the request's (start, end) spans"),
    (([2], [5], [7]), "spans[0]=7: expected the request's (start, end) spans"),
    ((torch.tensor([[2]]), [5], [[]]), "qo_lens: expected a 1-D integer tensor (or a list), got a 2-D torch.int64"),
    (([2], torch.tensor([5.0]), [[]]), "kv_lens: expected a 1-D integer tensor (or a list), got a 1-D torch.float32"),
])
def test_spans_to_ranges_names_bad_input(args, message):
    with pytest.raises(ValueError, match="^spans_to_ranges: ") as e:
        variantgen.spans_to_ranges(*args)
    assert message in str(e.value)


def test_spans_to_ranges_takes_length_tensors():
    """An engine's sequence lengths are often int tensors (they raised a raw TypeError or 'expected
    whole numbers' before)."""
    want = variantgen.spans_to_ranges([3, 2], [5, 4], [[(1, 2)], []])
    got = variantgen.spans_to_ranges(torch.tensor([3, 2], dtype=torch.int32), torch.tensor([5, 4]), [[(1, 2)], []])
    assert torch.equal(got, want) and want.tolist() == [[1, 2], [-1, -1], [-1, -1], [-1, -1], [-1, -1]]


# ----------------------------------------------------------------------------- tree_bits


def test_tree_bits_sets_each_node_and_its_ancestors():
    bits = variantgen.tree_bits([[-1, 0, 0, 1, -1], [-1]])
    assert bits.dtype == torch.int32 and bits.shape == (6, 2)
    assert bits[:, 0].tolist() == [0b1, 0b11, 0b101, 0b1011, 0b10000, 0b1] and not bits[:, 1].any()
    chain = variantgen.tree_bits([list(range(-1, 63))])  # node k: bits 0..k, the last word's bit 31 negative
    assert chain[31].tolist() == [-1, 0] and chain[32].tolist() == [-1, 1] and chain[63].tolist() == [-1, -1]
    assert variantgen.tree_bits([[], []]).shape == (0, 2)
    assert variantgen.tree_bits([[-1, 0]], words=1, device="cpu").tolist() == [[1], [3]]
    assert torch.equal(variantgen.tree_bits([torch.tensor([-1, 0, 0, 1, -1]), [-1]]),
                       variantgen.tree_bits([[-1, 0, 0, 1, -1], [-1]]))  # (an engine's index tensors)


@pytest.mark.parametrize(("args", "message"), [
    (([[0]],), "tree_bits: parents[0][0]=0: expected -1 (a root) (node 0 has no earlier node) (nodes are in "
               "topological order)"),
    (([[-1, 1]],), "tree_bits: parents[0][1]=1: expected -1 (a root) or an earlier node 0..0"),
    (([[-1], [-1, -2]],), "tree_bits: parents[1][1]=-2: expected -1 (a root)"),
    (([[-1, True]],), "tree_bits: parents[0][1]=True"),
    (([list(range(-1, 64))],), "tree_bits: request 0 has 65 draft nodes; 2 word(s) per row hold at most 64"),
    (([[-1]] * 2, ), None),
    (([["a"]],), "tree_bits: parents[0][0]='a'"),
    (("x",), "tree_bits: parents: expected a list with one list of parent indices per request, got str"),
    ((None,), "tree_bits: parents: expected a list with one list of parent indices per request, got NoneType"),
    ((["x"],), "tree_bits: parents[0]: expected a list of parent indices, got str"),
    (([torch.tensor([-1.0])],), "tree_bits: parents[0]: expected a list of parent indices, got Tensor"),
])
def test_tree_bits_names_bad_input(args, message):
    if message is None:
        assert variantgen.tree_bits(*args).shape == (2, 2)
        return
    with pytest.raises(ValueError) as info:
        variantgen.tree_bits(*args)
    assert str(info.value).startswith(message)


# ----------------------------------------------------------------------------- make_wrapper's own arguments


@pytest.mark.parametrize(("kw", "message"), [
    ({"build": "no"}, "make_wrapper(): `build`='no': expected True or False"),
    ({"build": None}, "make_wrapper(): `build`=None: expected True or False"),
    ({"use_tensor_cores": "yes", "kind": "decode"}, "make_wrapper(): `use_tensor_cores`='yes': expected True or "
                                                    "False"),
    ({"check_plan": "no"}, "make_wrapper(): `check_plan`='no': expected True, False or None"),
    ({"cache": "/tmp/cache"}, "make_wrapper(): cache='/tmp/cache': expected a variantgen.build.cache.Cache (e.g. "
                              "Cache(path)), or None for the default cache (VARIANTGEN_CACHE_DIR)"),
    ({"jobs": "4"}, "make_wrapper(): jobs='4': expected a positive int (parallel compile jobs, at most 2147483647), "
                    "or None"),
    ({"jobs": 0}, "make_wrapper(): jobs=0: expected a positive int (parallel compile jobs, at most 2147483647), or "
                  "None"),
    ({"jobs": 2**31}, "make_wrapper(): jobs=2147483648: expected a positive int (parallel compile jobs, at most "
                      "2147483647), or None"),
])
def test_make_wrapper_names_malformed_settings(kw, message):
    """A regression: build= and use_tensor_cores= were read as truthy ("no" built, "yes"/1 chose tensor cores),
    check_plan="no" was reported as check_plan=True, a cache path raised AttributeError ('str' object has no
    attribute 'root'), and jobs= reached ninja's command line unchecked (2**31 and more: ninja's "invalid -j
    parameter")."""
    workspace = torch.empty(1 << 20, dtype=torch.uint8)
    with pytest.raises(ValueError) as info:
        variantgen.make_wrapper("causal", workspace, head_dim_qk=64, q_dtype="fp16", kv_dtype="fp16", **kw)
    assert str(info.value) == message


# ----------------------------------------------------------------------------- spans_to_ranges / tree_bits: limits


def test_spans_to_ranges_refuses_keys_past_int32():
    """A regression: a kv_len past 2**31 - 1 with a span there raised torch's 'value cannot be converted to
    type int without overflow' from filling the int32 tensor."""
    with pytest.raises(ValueError, match=r"^spans_to_ranges: request 0: kv_lens\[0\]=4294967296: expected at most "
                                         r"2\*\*31 - 1 \(ranges holds int32 key positions\)$"):
        variantgen.spans_to_ranges([1], [1 << 32], [[(1 << 31, (1 << 31) + 5)]])


def test_tree_bits_words_is_bounded():
    """A regression: words=2**40 built a row of 2**40 ints (the process ran out of memory)."""
    with pytest.raises(ValueError, match=r"^tree_bits: words=1099511627776: expected a positive int of at most 65536 "
                                         r"\(a spec tensor's fixed dimension\)$"):
        variantgen.tree_bits([[-1]], words=1 << 40)


@pytest.mark.parametrize("helper", ["spans_to_ranges", "tree_bits"])
def test_helpers_name_a_bad_device(helper):
    """A regression: device='bogus' raised torch's RuntimeError, which names no argument."""
    call = {"spans_to_ranges": lambda **kw: variantgen.spans_to_ranges([1], [2], [[]], **kw),
            "tree_bits": lambda **kw: variantgen.tree_bits([[-1]], **kw)}[helper]
    with pytest.raises(ValueError, match=f"^{helper}: device='bogus': expected a torch device this process can use "):
        call(device="bogus")
    assert call(device=torch.device("cpu")).device.type == "cpu"
