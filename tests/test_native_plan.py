"""The planner module's build_launches (native_plan.py) against the Python path it replaces
(planner.launches_from_segments + regroup_for_fa3 + the wrapper's metadata layout), on the
CPU: the module is built with nvcc and its host function called directly. plan_batch (the
same host code after a row pass and a read-back) needs a GPU: tests/test_gpu_*.py run it;
here a stand-in built from the fake row pass and the real build_launches drives plan()'s
native path end to end."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from _fake_kernel import FakeRowPlanner
from conftest import SPECS_DIR

from variantgen import build
from variantgen.cache import Cache
from variantgen.native_plan import fa3_cta_tile_q
from variantgen.plan_abi import (
    DESC_FIELDS,
    FA3_MAX_WINDOW_LAUNCHES,
    HEADER_FIELDS,
    LAUNCH_FIELDS,
    MAX_LAUNCHES,
    ROW_BLOCK,
    SEG_FIELDS,
    HeaderField,
    LaunchField,
    MaskMode,
    RecField,
)
from variantgen.planner import (
    CAUSAL,
    CUSTOM,
    DENSE,
    WINDOW,
    gather_pages,
    launches_from_segments,
    page_gather_table,
    regroup_for_fa3,
)
from variantgen.rowplan import PlannerConfig
from variantgen.spec import load_spec
from variantgen.testing import random_paged_batch, random_spec_args

pytestmark = pytest.mark.nvcc
HQ, HKV, SMS = 32, 8, 132  # the H200-sized schedules of the direct build_launches tests


_BUILT: dict[str, object] = {}


@pytest.fixture
def planner_module(tmp_path_factory, toolchain):
    """The causal spec's planner module (any spec's has the same host functions), built once."""
    if "module" not in _BUILT:
        cache = Cache(tmp_path_factory.mktemp("native_plan_cache"))
        spec = load_spec(SPECS_DIR / "causal.yaml")
        _BUILT["module"] = build.load_module(build.build_module(PlannerConfig(spec, "9.0a"), cache).entry)
    return _BUILT["module"]


def random_segments(rng: random.Random, qo_lens: list[int], kv_lens: list[int], page_size: int) -> list[list[int]]:
    """A segment table like read_segments': each request's rows cut into runs of one class."""
    table, row = [], 0
    widths = [rng.choice([3, 17, 40, 64, 100, 200]) for _ in range(7)]
    for req, (q, k) in enumerate(zip(qo_lens, kv_lens)):
        r = 0
        while r < q:
            n = min(q - r, rng.randint(1, 90))
            first, last = k - q + r, k - q + r + n - 1
            cls = rng.choice([DENSE, CAUSAL, WINDOW, CUSTOM])
            if cls == DENSE:
                lo = rng.randrange(0, k, page_size) if rng.random() < 0.5 else 0
                pa, slo, shi = lo, lo, rng.randint(lo, k - 1)
            elif cls == CAUSAL:
                pa = min(rng.randrange(0, first + 1, page_size), first // page_size * page_size)
                slo, shi = pa, first
            elif cls == WINDOW:
                pa = rng.choice(widths)
                slo, shi = max(first - pa, 0), first
            else:
                slo = rng.randint(0, last)
                pa, shi = r // 128, rng.randint(slo, k - 1)
            table.append([row + r, row + r + n, req, cls, pa, slo, shi, first, last])
            r += n
        row += q
    return table


def python_launches(table, qo_lens, kv_lens, kvp_h, page_size, fa3):
    batch = SimpleNamespace(page_size=page_size, qo_lens=tuple(qo_lens), total_q=sum(qo_lens))
    launches = launches_from_segments(SimpleNamespace(_batch=batch, plan_stats={}), table, kvp_h, kv_lens)
    return regroup_for_fa3(launches) if fa3 else launches


def native_launches(module, table, qo_lens, kv_lens, kvp_h, page_size, fa3, min_tiles=0, capacity=1 << 22):
    kv_row_base = [sum(kv_lens[:i]) for i in range(len(kv_lens))]
    requests = torch.tensor([kvp_h[:-1], kv_row_base, qo_lens, kv_lens], dtype=torch.int64)
    segments = torch.tensor(table, dtype=torch.int64).view(-1, SEG_FIELDS)
    host = torch.zeros(capacity, dtype=torch.uint8)
    desc = torch.zeros(DESC_FIELDS, dtype=torch.int64)
    module.build_launches(segments, requests, host, desc, sum(qo_lens), page_size, fa3, FA3_MAX_WINDOW_LAUNCHES,
                          SMS, fa3_cta_tile_q(128), HQ, HKV, 128, 128, 2, min_tiles)
    return host, desc


def decode(host, desc):
    head = {f.name.lower(): v for f, v in zip(HeaderField, desc[:HEADER_FIELDS].tolist())}
    ints = host.view(torch.int32)
    out = []
    for i in range(head["launches"]):
        d = desc[HEADER_FIELDS + i * LAUNCH_FIELDS:HEADER_FIELDS + (i + 1) * LAUNCH_FIELDS].tolist()
        la = {f.name.lower(): d[f] for f in LaunchField if f < LaunchField.INFO}
        n, at = la["requests"], la["offset"] // 4
        q_starts, kv_indptr, last, meta, plan_qo = ints[at:at + 13 * n + 3].split([n + 1, n + 1, n, 9 * n, n + 1])
        la.update(q_starts=q_starts.tolist(), kv_indptr=kv_indptr.tolist(), last_page_len=last.tolist(),
                  meta=meta.view(n, 9).tolist(), plan_qo=plan_qo.tolist(),
                  info=d[LaunchField.INFO:LaunchField.INFO + la["info_len"]])
        out.append(la)
    table = ints[head["table_offset"] // 4:head["table_offset"] // 4 + 2 * head["ranges"]].view(2, -1)
    return head, out, table


def check_fa3_work_list(host, la, page_size):
    """Every (launch request, query tile) once, with its request's rows, pages and lengths."""
    info, n = la["info"], la["requests"]
    ints = host.view(torch.int32)

    def field(k, count):
        return ints[info[k] // 4:info[k] // 4 + count].tolist()

    work_indptr = field(6, SMS + 1)
    works = work_indptr[-1]
    assert work_indptr[0] == 0 and all(a <= b for a, b in zip(work_indptr, work_indptr[1:])) and info[8] == 1
    tile, q_first, kv_first, q_len, k_len, _head, batch = (field(k, works) for k in (0, 1, 2, 3, 4, 5, 7))
    cta = fa3_cta_tile_q(128)
    want = {(b, t) for b in range(n) for t in range(-(-(la["plan_qo"][b + 1] - la["plan_qo"][b]) // cta))}
    assert sorted(zip(batch, tile)) == sorted(want)
    for w in range(works):
        b = batch[w]
        pages = la["kv_indptr"][b + 1] - la["kv_indptr"][b]
        keys = (pages - 1) * page_size + la["last_page_len"][b] if pages else 0
        assert (q_first[w], kv_first[w], q_len[w], k_len[w]) == (
            la["q_starts"][b], la["kv_indptr"][b], la["plan_qo"][b + 1] - la["plan_qo"][b], keys)


@pytest.mark.parametrize("fa3", [False, True], ids=["fa2", "fa3"])
@pytest.mark.parametrize("seed", range(6))
def test_build_launches_matches_the_python_path(planner_module, fa3, seed):
    rng = random.Random(seed)
    page_size = rng.choice([1, 16, 64])
    batch = rng.randint(1, 6)
    qo_lens = [rng.choice([1, 7, 130, 300]) for _ in range(batch)]
    kv_lens = [q + rng.choice([0, 5, 700]) for q in qo_lens]
    pages_per = [-(-k // page_size) for k in kv_lens]
    kvp_h = [sum(pages_per[:i]) for i in range(batch + 1)]
    table = random_segments(rng, qo_lens, kv_lens, page_size)
    kv_indices = torch.randperm(kvp_h[-1] + 5, dtype=torch.int64).to(torch.int32)

    want = python_launches(table, qo_lens, kv_lens, kvp_h, page_size, fa3)
    host, desc = native_launches(planner_module, table, qo_lens, kv_lens, kvp_h, page_size, fa3)
    head, got, table_t = decode(host, desc)
    assert [(la["mode"], la["window_left"]) for la in got] == [
        (MaskMode.of(w["mask_mode"]), w.get("window_left", -1)) for w in want]
    counts = {name: sum(1 for s in table if s[3] == c) for name, c in
              (("dense", DENSE), ("causal", CAUSAL), ("window", WINDOW), ("custom", CUSTOM))}
    assert {k: head[k] for k in counts} == counts
    assert head["custom_rows"] == sum(s[1] - s[0] for s in table if s[3] == CUSTOM)
    # the page lists: the Python ranges gathered == the table's gather, launch by launch
    ranges = [r for w in want for r in w["page_ranges"]]
    want_table, total = page_gather_table(ranges)
    assert head["total_pages"] == total and head["ranges"] == len(want_table) // 2
    assert table_t.flatten().tolist() == want_table
    pages = gather_pages(kv_indices, table_t, total, torch.device("cpu"))
    for w, la in zip(want, got):
        n = len(w["meta"])
        assert la["requests"] == n and la["rows"] == w["plan_qo"][-1]
        for key in ("q_starts", "kv_indptr", "last_page_len", "meta", "plan_qo"):
            assert la[key] == w[key], key
        assert bool(la["packed"]) == w["packed"]
        mine = pages[la["page_at"]:la["page_at"] + la["pages"]]
        theirs = torch.cat([kv_indices[a:a + c] for a, c in w["page_ranges"]]) if la["pages"] else mine
        assert torch.equal(mine, theirs)
        if fa3:
            assert la["schedule"] == 2 and len(la["info"]) == 9
            check_fa3_work_list(host, la, page_size)
        else:  # the planner module's fa2 work list of that launch, at the same offset
            assert la["schedule"] == 1 and len(la["info"]) == 15
            alone = torch.zeros_like(host)
            base = la["info"][4]
            qo = torch.tensor(w["plan_qo"], dtype=torch.int32)
            o = torch.tensor(w["q_starts"], dtype=torch.int32)
            info = list(planner_module.schedule(alone, base, qo, o, HQ, HKV, 128, 128, 2, 0))
            end = info.pop()
            assert info == la["info"] and torch.equal(alone[base:end], host[base:end])
    assert head["pages_offset"] % 16 == 0 and head["copy_bytes"] == head["pages_offset"]


def test_build_launches_leaves_small_fa2_launches_to_flashinfer_and_asks_for_room(planner_module):
    qo_lens, kv_lens, page_size = [40, 40], [40, 900], 16
    pages_per = [-(-k // page_size) for k in kv_lens]
    kvp_h = [0, pages_per[0], sum(pages_per)]
    table = [[0, 40, 0, CAUSAL, 0, 0, 39, 0, 39], [40, 80, 1, DENSE, 0, 0, 899, 860, 899]]
    # 2 launches of 10 query tiles each (4 heads per group, 16-row tiles): below the 33-tile
    # bar for 132 SMs and 8 KV heads, FlashInfer schedules them (it may split KV)
    host, desc = native_launches(planner_module, table, qo_lens, kv_lens, kvp_h, page_size, False,
                                 min_tiles=2 * SMS // HKV)
    head, got, _ = decode(host, desc)
    assert [la["schedule"] for la in got] == [0, 0] and all(la["info_len"] == 0 for la in got)
    host, desc = native_launches(planner_module, table, qo_lens, kv_lens, kvp_h, page_size, False, min_tiles=0)
    assert [la["schedule"] for la in decode(host, desc)[1]] == [1, 1]
    # a buffer too small for the work lists: desc[0] asks for more, and that is enough
    need = -int(native_launches(planner_module, table, qo_lens, kv_lens, kvp_h, page_size, True, capacity=256)[1][0])
    assert need > 256
    host, desc = native_launches(planner_module, table, qo_lens, kv_lens, kvp_h, page_size, True, capacity=need)
    assert desc[0] > 0 and [la["mode"] for la in decode(host, desc)[1]] == [1, 0]


def test_build_launches_never_leaves_a_windowed_fa2_launch_to_flashinfer(planner_module):
    """A launch with a kernel window gets the planner module's work list (no split-KV) however
    small: FlashInfer's split-KV would size the window's partial rows differently from its
    kernel (issue 14: wrong rows and NaN on the H200)."""
    qo_lens, kv_lens, page_size = [40, 40], [40, 900], 16
    pages_per = [-(-k // page_size) for k in kv_lens]
    kvp_h = [0, pages_per[0], sum(pages_per)]
    table = [[0, 40, 0, CAUSAL, 0, 0, 39, 0, 39], [40, 80, 1, WINDOW, 5, 855, 860, 860, 899]]
    host, desc = native_launches(planner_module, table, qo_lens, kv_lens, kvp_h, page_size, False,
                                 min_tiles=2 * SMS // HKV)
    (launch,) = decode(host, desc)[1]
    assert launch["schedule"] == 1 and launch["info_len"] == 15
    assert [row[7] for row in launch["meta"]] == [-1, 5]


def test_build_launches_names_a_bad_segment_table(planner_module):
    with pytest.raises(Exception, match="segments: row 0 is not a launch request of this batch"):
        native_launches(planner_module, [[0, 10, 3, CAUSAL, 0, 0, 9, 0, 9]], [10], [10], [0, 1], 16, False)


def test_plan_batch_names_bad_indices(planner_module):
    """plan_batch checks its host inputs before any CUDA call (the rest needs a GPU)."""
    def call(indices):
        i64 = [torch.zeros(n, dtype=torch.int64) for n in (4, 4, 70)]
        planner_module.plan_batch(indices, *i64, torch.zeros(1, dtype=torch.int32), torch.zeros(10, dtype=torch.int64),
                                  torch.zeros(10, dtype=torch.int64), torch.zeros(1, dtype=torch.uint8),
                                  torch.zeros(2, dtype=torch.int32), torch.zeros(64, dtype=torch.uint8),
                                  torch.zeros(64, dtype=torch.uint8), torch.zeros(MAX_LAUNCHES, dtype=torch.int64), 64,
                                  True, FA3_MAX_WINDOW_LAUNCHES, SMS, 128, HQ, HKV, 128, 128, 2, 0, 16)

    for bad in (torch.tensor([0, 10, 0, 1, 10], dtype=torch.int64), torch.tensor([0, 10, 0, 1], dtype=torch.int32)):
        with pytest.raises(Exception, match=r"indices: expected int32 \[3 batch \+ 2\] on the host"):
            call(bad)


# ----------------------------------------------------------------------------- through the wrapper
class NativeRowPlanner(FakeRowPlanner):
    """The fake row kernel (torch rules) with the real planner module's build_launches, put
    together the way the module's plan_batch does on the GPU, so that plan() takes the native
    path on the CPU; the fake kernels run its launches."""

    def __init__(self, spec, module):
        super().__init__(spec)
        self.build_launches = module.build_launches
        self.batches = 0

    def plan_batch(self, indices, starts_page_locked, starts, rec, counts, seg, seg_host, scratch, kv_indices,
                   workspace, workspace_host, desc, expect, fa3, max_window_launches, num_sm, cta_tile_q, hq, hkv,
                   head_dim_qk, head_dim_vo, kv_dtype_bytes, fa2_min_tiles, *spec_args_and_page_size):
        self.batches += 1
        assert indices.dtype == torch.int32 and indices.device.type == "cpu" and indices.dim() == 1
        batch = (indices.numel() - 2) // 3
        page_size = spec_args_and_page_size[-1]
        qo, page_indptr, last = indices.split([batch + 1, batch + 1, batch])
        qo, page_indptr, last = qo.tolist(), page_indptr.tolist(), last.tolist()
        kv_start = [0]
        for b in range(batch):
            pages = page_indptr[b + 1] - page_indptr[b]
            kv_start.append(kv_start[-1] + ((pages - 1) * page_size + last[b] if pages else 0))
        total_q = qo[-1]
        batch_host = torch.tensor([qo, kv_start], dtype=torch.int64)
        assert seg_host.numel() >= seg.numel() and workspace.numel() >= workspace_host.numel()
        self.plan_rows(rec[:len(RecField) * total_q].view(len(RecField), total_q), batch_host,
                       starts_page_locked, starts, scratch, counts[:-(-total_q // ROW_BLOCK)], seg,
                       *spec_args_and_page_size)
        seg_host[:seg.numel()] = seg
        count = int(seg_host[0])
        if count > (seg.numel() - 1) // SEG_FIELDS:
            return count
        requests = torch.tensor([page_indptr[:-1], kv_start[:-1], [b - a for a, b in zip(qo, qo[1:])],
                                 [b - a for a, b in zip(kv_start, kv_start[1:])]], dtype=torch.int64)
        self.build_launches(seg_host[1:1 + SEG_FIELDS * count].view(count, SEG_FIELDS), requests, workspace_host,
                            desc, total_q, page_size, fa3, max_window_launches, num_sm, cta_tile_q, hq, hkv,
                            head_dim_qk, head_dim_vo, kv_dtype_bytes, fa2_min_tiles)
        copy_bytes, table_off, ranges, pages_off, total_pages = desc[:5].tolist()
        if copy_bytes < 0:
            return count
        workspace[:copy_bytes] = workspace_host[:copy_bytes]
        ints = workspace.view(torch.int32)
        table = ints[table_off // 4:table_off // 4 + 2 * ranges].view(2, ranges)
        gather_pages(kv_indices, table, total_pages, workspace.device, out=ints[pages_off // 4:][:total_pages])
        return count


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("spec_name", ["mm_prefix", "sliding_window", "document", "prefix_lm"])
def test_native_plan_matches_the_reference(planner_module, spec_name, backend):
    from test_wrapper_cpu import HEAD_DIM, HKV, HQ, check

    spec = load_spec(SPECS_DIR / f"{spec_name}.yaml")
    cases = [([33, 200, 1], [33, 450, 9], 16), ([300], [300], 4), ([5, 64], [70, 64], 1)]
    for seed, (qo, kv, page) in enumerate(cases):
        batch = random_paged_batch(qo, kv, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM, page_size=page,
                                   seed=seed)
        args = random_spec_args(spec, batch, seed=seed)
        w, _ = check(spec, batch, args, skip_tiles=True, backend=backend, label=f"{spec_name} {seed}",
                     row_planner=NativeRowPlanner(spec, planner_module))
        assert w.plan_stats["row_planner"] == "kernel" and w.plan_stats["launches"]
        assert all(la.int_workspace.data_ptr() == w._schedule_workspace()[0].data_ptr() for la in w._launches)


def test_native_plan_leaves_small_fa2_launches_to_flashinfers_scheduler(planner_module, monkeypatch):
    """Below FlashInfer's split-KV bar its scheduler plans the launch (in its own workspace),
    and rows that are not back to back keep their place in o."""
    from test_wrapper_cpu import HEAD_DIM, HKV, HQ, check

    spec = load_spec(SPECS_DIR / "mm_prefix.yaml")
    monkeypatch.setattr("variantgen.wrapper.VariantWrapper._num_sms", lambda self: 10_000)
    batch = random_paged_batch([40, 90], [40, 300], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM,
                               page_size=16, seed=3)
    w, fake = check(spec, batch, random_spec_args(spec, batch, seed=3), skip_tiles=True,
                    row_planner=NativeRowPlanner(spec, planner_module))
    assert fake.plan_calls and len(fake.plan_calls) == len(w._launches)
    assert all(la.int_workspace.data_ptr() != w._schedule_workspace()[0].data_ptr() for la in w._launches)


def test_native_plan_grows_the_schedule_workspace(planner_module, monkeypatch):
    """A batch whose launches do not fit the schedule workspace: plan() grows it and goes on."""
    from test_wrapper_cpu import HEAD_DIM, HKV, HQ, check

    import variantgen.wrapper as wrapper_mod

    monkeypatch.setattr(wrapper_mod, "INT_WORKSPACE_BYTES", 512)
    spec = load_spec(SPECS_DIR / "mm_prefix.yaml")
    batch = random_paged_batch([300, 200], [300, 260], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM,
                               page_size=4, seed=5)
    w, _ = check(spec, batch, random_spec_args(spec, batch, seed=5), skip_tiles=True,
                 row_planner=NativeRowPlanner(spec, planner_module))
    assert w._schedule_workspace()[0].numel() > 512


def test_native_plan_grows_the_segment_read_back(planner_module):
    """More launch requests than the read-back has room for: plan_batch answers the count
    (nothing built), plan() calls it again with room for all, and the next plan() starts
    with room for twice as many (one call)."""
    from test_wrapper_cpu import HEAD_DIM, HKV, HQ, make

    from variantgen.reference import reference_attention

    spec = load_spec(SPECS_DIR / "mm_prefix.yaml")
    batch = random_paged_batch([64, 48, 90], [64, 80, 90], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM,
                               page_size=16, seed=7)
    args = random_spec_args(spec, batch, seed=7)
    planner = NativeRowPlanner(spec, planner_module)
    w, _ = make(spec)
    w.set_row_planner(planner)
    w.segment_capacity = 1
    w.plan(*batch.plan_args(), skip_tiles=True, **args)
    n = sum(count for _, count in w.plan_stats["launches"])
    assert n > 1 and planner.batches == 2 and w.segment_capacity >= 2 * n
    out = w.run(batch.q, (batch.k_cache, batch.v_cache), **args)
    ref = reference_attention(spec, batch.q, (batch.k_cache, batch.v_cache), batch.qo_indptr, batch.kv_indptr,
                              batch.kv_indices, batch.last_page_len, args)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    w.plan(*batch.plan_args(), skip_tiles=True, **args)
    assert planner.batches == 3  # one call now


def test_native_plan_names_a_workspace_that_never_fits(planner_module, monkeypatch):
    from test_wrapper_cpu import HEAD_DIM, HKV, HQ, check

    from variantgen.errors import LaunchError

    def never_large_enough(self, nbytes):  # a broken grow: always 256 bytes
        self._sched_ws = (torch.empty(256, dtype=torch.uint8), torch.empty(256, dtype=torch.uint8))

    monkeypatch.setattr("variantgen.wrapper.WrapperBase._grow_schedule_workspace", never_large_enough)
    spec = load_spec(SPECS_DIR / "causal.yaml")
    batch = random_paged_batch([100], [100], num_qo_heads=HQ, num_kv_heads=HKV, head_dim=HEAD_DIM, page_size=4)
    with pytest.raises(LaunchError, match="internal: plan_batch still asks for room"):
        check(spec, batch, {}, skip_tiles=True, row_planner=NativeRowPlanner(spec, planner_module))


def test_native_plan_checks_page_numbers_and_copies_the_page_list(planner_module):
    """The native path's launches read the page list gathered in plan(); its bounds are checked
    as on every path (tests/test_run_checks_cpu.py): negative entries by plan(), entries past the
    cache by run()."""
    from test_run_checks_cpu import assert_reference, mm_case, plan_prefill, prefill

    from variantgen.errors import LaunchError

    spec, batch, args = mm_case(qo_lens=(20, 9), kv_lens=(40, 9), seed=6)
    w, fake = prefill(spec)
    w.set_row_planner(NativeRowPlanner(spec, planner_module))
    kv = batch.kv_indices.clone()
    kv[5] = -2
    with pytest.raises(LaunchError, match=r"^plan\(\): paged_kv_indices\[5\]=-2 is not a page number"):
        plan_prefill(w, batch, args, True, kv)
    pages = batch.k_cache.shape[0]
    kv[5] = pages
    plan_prefill(w, batch, args, True, kv)
    assert w.plan_stats["row_planner"] == "kernel"
    with pytest.raises(LaunchError, match=rf"^run\(\): paged_kv_indices\[5\]={pages} is not a page of the KV cache "
                                          rf"run\(\) was given \({pages} pages"):
        w.run(batch.q, (batch.k_cache, batch.v_cache), **args)
    assert fake.run_calls == []
    kv.copy_(batch.kv_indices)
    plan_prefill(w, batch, args, True, kv)
    kv.fill_(1 << 20)  # after plan(): the launches hold their gathered copy
    assert_reference(spec, w.run(batch.q, (batch.k_cache, batch.v_cache), **args), batch, args)


def test_native_plan_with_check_plan(planner_module):
    from test_run_checks_cpu import assert_reference, mm_case, plan_prefill, prefill, rewrite_ranges

    from variantgen.errors import LaunchError

    spec, batch, args = mm_case(qo_lens=(20, 9), kv_lens=(40, 9), seed=6)
    w, _ = prefill(spec, check_plan=True)
    w.set_row_planner(NativeRowPlanner(spec, planner_module))
    plan_prefill(w, batch, args, True)
    assert w.plan_stats["row_planner"] == "kernel"
    assert_reference(spec, w.run(batch.q, (batch.k_cache, batch.v_cache), **args), batch, args)
    rewrite_ranges(args["ranges"])
    with pytest.raises(LaunchError, match=r"^run\(\): `ranges` changed since plan\(\) read it \(check_plan=True\)"):
        w.run(batch.q, (batch.k_cache, batch.v_cache), **args)
    plan_prefill(w, batch, args, True)
    assert_reference(spec, w.run(batch.q, (batch.k_cache, batch.v_cache), **args), batch, args)
