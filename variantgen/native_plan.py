"""plan()'s launches built by the spec's planner module in one host call.

planner.launches_from_segments, regroup_for_fa3 and the wrapper's metadata staging do in
Python what the planner module's ``build_launches`` does in C++ (templates/planner/): turn the
compacted launch requests into launches, each with its metadata (q_starts, kv_indptr,
last_page_len, vg_meta) and its schedule (an fa3 work list, or an fa2 one where KV is not
split), all written to one page-locked buffer. plan() then makes one host-to-device copy,
one page-gather launch and a few views per launch (README: plan() time, measured per run in
bench/results/plan-s5-*.json).

The wrapper's shared schedule workspace (device buffer + page-locked mirror, the same size)
holds, from offset 0: the page gather table, each launch's metadata, each launch's schedule,
then the gathered page list (written on the device). ``desc`` (int64, host) says where:
HEADER fields, then LAUNCH_FIELDS per launch.
"""

from __future__ import annotations

from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from .errors import LaunchError
from .graph import META_COLUMNS
from .planner import FA3_MAX_WINDOW_LAUNCHES, gather_pages
from .render import MASK_MODES

if TYPE_CHECKING:
    from .wrapper import Launch, VariantWrapper

HEADER = ("copy_bytes", "table_offset", "ranges", "pages_offset", "total_pages", "launches",
          "dense", "causal", "window", "custom", "custom_rows")
LAUNCH = ("mode", "window_left", "requests", "offset", "packed", "schedule", "rows", "page_at", "pages",
          "info_len")  # then up to 15 plan_info values
LAUNCH_FIELDS = len(LAUNCH) + 15
MAX_LAUNCHES = 8  # custom, none, causal split into at most 1 + FA3_MAX_WINDOW_LAUNCHES + custom
SCHEDULE_NONE, SCHEDULE_FA2, SCHEDULE_FA3 = 0, 1, 2
MODE_NAMES = {code: name for name, (code, _) in MASK_MODES.items()}
DESC_FIELDS = len(HEADER) + LAUNCH_FIELDS * MAX_LAUNCHES  # the int64 answer build_launches writes


def fa3_cta_tile_q(head_dim_vo: int) -> int:
    """Query rows per tile of FlashInfer's sm90 prefill kernel (its dispatch by head dim)."""
    return 192 if head_dim_vo == 64 else 128


def has_native_build(module: object) -> bool:
    return hasattr(module, "build_launches")


def build_launches(w: VariantWrapper, segments: torch.Tensor, kvp_h: list[int], kv_lens: list[int],
                   kv_indices: torch.Tensor, disable_split_kv: bool) -> list[Launch]:
    """The launches of ``segments`` (read_segments' host table) on the wrapper's device."""
    from .wrapper import Launch

    b, cfg = w._batch, w.config
    assert b is not None
    kv_row_base = list(accumulate(kv_lens))[:-1]
    requests = torch.tensor([kvp_h[:-1], [0, *kv_row_base], list(b.qo_lens), kv_lens], dtype=torch.int64)
    desc = w._native_desc
    fa3 = cfg.backend == "fa3"
    for _ in range(3):  # the answer to a too-small buffer is the exact size: one retry suffices
        device_ws, host_ws = w._schedule_workspace()
        w.row_planner.build_launches(
            segments, requests, host_ws, desc, b.total_q, b.page_size, fa3, FA3_MAX_WINDOW_LAUNCHES, w._num_sms(),
            fa3_cta_tile_q(cfg.head_dim_vo), b.num_qo_heads, b.num_kv_heads, cfg.head_dim_qk, cfg.head_dim_vo,
            w._kv_dtype_bytes(), w._own_schedule_min_tiles(disable_split_kv))
        head = desc[:len(HEADER)].tolist()
        if head[0] >= 0:
            break
        w._grow_schedule_workspace(-head[0])
    else:
        raise LaunchError(f"internal: build_launches still asks for {-head[0]} bytes after growing the workspace")
    copy_bytes, table_off, ranges, pages_off, total_pages, n_launches = head[:6]
    device_ws[:copy_bytes].copy_(host_ws[:copy_bytes], non_blocking=True)
    ints = device_ws.view(torch.int32)
    pages = ints[pages_off // 4:pages_off // 4 + total_pages]
    table = ints[table_off // 4:table_off // 4 + 2 * ranges].view(2, ranges)
    gather_pages(kv_indices, table, total_pages, w.device, w.row_planner, out=pages)  # into the workspace
    w.plan_stats["segments"] = dict(zip(HEADER[6:], head[6:]))
    rows = desc[len(HEADER):len(HEADER) + LAUNCH_FIELDS * n_launches].view(n_launches, LAUNCH_FIELDS).tolist()
    chunk = w._float_workspace.numel() // max(n_launches, 1)
    launches = []
    for i, d in enumerate(rows):
        mode, window, n, offset, packed, schedule, nrows, page_at, npages, info_len = d[:len(LAUNCH)]
        at = offset // 4
        q_starts, kv_indptr, last_page_len, meta = ints[at:at + 12 * n + 2].split([n + 1, n + 1, n, 9 * n])
        float_ws = w._float_workspace[i * chunk:(i + 1) * chunk]
        int_ws = device_ws
        if schedule == SCHEDULE_NONE:  # fa2 where KV may be split: FlashInfer's scheduler
            host_ints = host_ws.view(torch.int32)  # plan_qo and kv_indptr of the launch, on the host
            int_ws, plan_info = w._flashinfer_plan(
                i, host_ints[at + 12 * n + 2:at + 13 * n + 3], host_ints[at + n + 1:at + 2 * n + 2], nrows,
                float_ws, disable_split_kv, None if packed else q_starts)
        else:
            plan_info = d[len(LAUNCH):len(LAUNCH) + info_len]
        launches.append(Launch(
            mask_mode=MODE_NAMES[mode], q_starts=q_starts, kv_indptr=kv_indptr,
            kv_indices=pages[page_at:page_at + npages], last_page_len=last_page_len,
            meta=meta.view(n, META_COLUMNS), window_left=window, plan_info=plan_info, int_workspace=int_ws,
            float_workspace=float_ws, num_requests=n))
    w.plan_stats["launches"] = [(la.mask_mode, la.num_requests) for la in launches]
    return launches
