"""probe() on a GPU: it answers for this machine (loaded here), make_wrapper(backend=None)
makes the same backend choice, and a server with JIT disabled whose cache lacks the fa3
module serves the precompiled fa2 one - correctly. Uses the mm_prefix hd128 bf16 modules
scripts/precompile_gpu_tests.sh builds (fa2, fa3 and the planner)."""

from __future__ import annotations

import shutil

import pytest
import torch
from _gpu import SPECS, rel_error

import variantgen
from variantgen.build.builder import default_cache
from variantgen.build.cache import Cache
from variantgen.core import env
from variantgen.testing.harness import random_paged_batch, random_spec_args
from variantgen.wrappers.reference import reference_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                       reason="needs an sm90 (Hopper) GPU"),
]
MM = SPECS / "mm_prefix.yaml"
ARGS = dict(head_dim_qk=128, q_dtype="bf16", kv_dtype="bf16")


@pytest.fixture
def fresh(monkeypatch):
    """An empty probe memo; environment changes undone afterwards."""
    variantgen.probe.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    env.reload_settings()
    variantgen.probe.cache_clear()


def test_probe_answers_for_this_gpu_and_make_wrapper_agrees(workspace, fresh):
    r = variantgen.probe(MM, **ARGS)
    assert r, r.reason
    assert r.details["loaded"] is True and r.details["device_arch"] == "9.0a" and r.details["backend"] == "fa3"
    w = variantgen.make_wrapper(MM, workspace, **ARGS)
    assert w.config.backend == r.details["backend"] and w.uri == r.uri
    other = variantgen.probe(MM, **ARGS, arch="8.0")
    assert not other and other.reason.startswith("arch=8.0 was given, but the visible GPU is 9.0a")
    with pytest.raises(ValueError, match=r"arch=8\.0 was given, but the workspace's GPU is 9\.0a"):
        variantgen.make_wrapper(MM, workspace, **ARGS, arch="8.0")  # (it built the sm80 module and loaded it)
    check = variantgen.probe(MM, **ARGS, arch="8.0", runtime=False, build=False)
    assert check.details.get("loaded", False) is False and "_sm80_" in (check.uri or "")


def test_jit_off_without_the_fa3_module_serves_fa2(workspace, fresh, tmp_path):
    fa2 = variantgen.probe(MM, **ARGS, backend="fa2")  # found (or built) in the shared cache
    assert fa2, fa2.reason
    served = tmp_path / "served"
    served.mkdir()
    shutil.copytree(default_cache().root / fa2.uri, served / fa2.uri)
    planner = fa2.details["row_planner"]
    if planner.startswith("cached: "):
        uri = planner.removeprefix("cached: ")
        shutil.copytree(default_cache().root / uri, served / uri)
    fresh.setenv("VARIANTGEN_CACHE_DIR", str(served))
    fresh.setenv("VARIANTGEN_DISABLE_JIT", "1")
    env.reload_settings()
    variantgen.probe.cache_clear()
    r = variantgen.probe(MM, **ARGS)
    assert r, r.reason
    assert r.details["backend"] == "fa2" and r.uri == fa2.uri and "is not precompiled" in r.details["note"]
    w = variantgen.make_wrapper(MM, workspace, **ARGS, cache=Cache(served))
    assert w.config.backend == "fa2" and w.uri == fa2.uri
    spec = variantgen.load_spec(MM)
    batch = random_paged_batch([300, 1, 129], [812, 700, 1000], num_qo_heads=32, num_kv_heads=8, head_dim=128,
                               page_size=16, device="cuda", seed=4)
    args = random_spec_args(spec, batch, seed=4)
    w.plan(*batch.plan_args(), **args)
    out = w.run(batch.q, (batch.k_cache, batch.v_cache), **args)
    ref = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr, batch.kv_indptr,
                              batch.kv_indices, batch.last_page_len, args)
    assert rel_error(out, ref) < 1e-2
