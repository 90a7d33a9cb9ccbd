"""plan()'s launches built by the spec's planner module in one host call.

The module's ``plan_batch`` (templates/planner/) runs the row pass, reads the compacted
launch requests back, and does in C++ what planner.launches_from_segments, regroup_for_fa3
and the wrapper's metadata staging do in Python: launches, each with its metadata
(q_starts, kv_indptr, last_page_len, vg_meta) and its schedule (an fa3 work list, or an fa2
one where KV is not split), written to one page-locked buffer, copied to the device in one
go, and the launches' page lists gathered there. What is left here is a few views per
launch: a plan() costs one call's argument passing rather than a few dozen tensor ops (README:
plan() time, measured in bench/results/<date>-<gpu>/plan-*.json).

The wrapper's shared schedule workspace (device buffer + page-locked mirror, the same size)
holds, from offset 0: the page gather table, each launch's metadata, each launch's schedule,
then the gathered page list (written on the device). ``desc`` (int64, host) says where:
HEADER fields, then LAUNCH_FIELDS per launch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .errors import LaunchError
from .intervals import usable_form
from .plan_abi import (
    FA3_MAX_WINDOW_LAUNCHES,
    HEADER_FIELDS,
    LAUNCH_FIELDS,
    META_COLUMNS,
    SEG_FIELDS,
    HeaderField,
    LaunchField,
    MaskMode,
    Schedule,
)
from .rowplan import call_layout, kept_buffer, row_buffers

if TYPE_CHECKING:
    from .wrapper import Launch, VariantWrapper



def fa3_cta_tile_q(head_dim_vo: int) -> int:
    """Query rows per tile of FlashInfer's sm90 prefill kernel (its dispatch by head dim)."""
    return 192 if head_dim_vo == 64 else 128


def has_native_plan(module: object) -> bool:
    return hasattr(module, "plan_batch")


def plan_batch(w: VariantWrapper, indices: torch.Tensor, args: dict[str, Any], kv_indices: torch.Tensor,
               disable_split_kv: bool) -> list[Launch]:
    """The launches of a batch from the planner module's ``plan_batch``: row pass, read-back,
    launches, copy and page gather in one host call. ``indices``: plan()'s qo_indptr,
    paged_kv_indptr and last_page_len back to back on the host (int32, checked);
    ``args``: the checked spec arguments."""
    b, cfg, spec, module = w._batch, w.config, w.spec, w.row_planner
    assert b is not None
    form, _, tensors = w._interval_facts
    if not form.planner_ready or not tensors <= args.keys():
        usable_form(spec, args)  # raises: which intervals or tensors are missing
    tensor_names, scalar_names, defaults, sorted_count = call_layout(spec, form)
    spec_values = [args[n] for n in tensor_names] + [args.get(n, defaults[n]) for n in scalar_names]
    kv_indices = kv_indices.to(w.device).contiguous()
    desc = w._native_desc
    for _ in range(4):  # a too-small buffer is answered with the size it needs: one retry each
        bufs = row_buffers(w.row_buffers, b.batch_size, b.total_q, sorted_count, w.segment_capacity, w.device)
        seg = bufs.seg
        seg_host = kept_buffer(w.row_buffers, "seg_host", seg.numel(), torch.int64, torch.device("cpu"), w.device)
        device_ws, host_ws = w._schedule_workspace()
        count = module.plan_batch(
            indices, bufs.starts_page_locked, bufs.starts, bufs.rec, bufs.counts, seg, seg_host, bufs.scratch,
            kv_indices, device_ws, host_ws, desc, w.segment_read, cfg.backend == "fa3", FA3_MAX_WINDOW_LAUNCHES,
            w._num_sms(), fa3_cta_tile_q(cfg.head_dim_vo), b.num_qo_heads, b.num_kv_heads, cfg.head_dim_qk,
            cfg.head_dim_vo, w._kv_dtype_bytes(), w._own_schedule_min_tiles(disable_split_kv), *spec_values,
            b.page_size)
        w._staging.queued()  # the starts and the workspace go over from kept page-locked buffers
        # room for twice this batch's launch requests next time, and a first read-back of that many
        w.segment_capacity = max(w.segment_capacity, 1 << (2 * count).bit_length())
        w.segment_read = max(64, 2 * count)
        if count > (seg.numel() - 1) // SEG_FIELDS:
            continue
        values = desc.tolist()
        if values[HeaderField.COPY_BYTES] >= 0:
            break
        w._grow_schedule_workspace(-values[HeaderField.COPY_BYTES])
    else:
        raise LaunchError("internal: plan_batch still asks for room after the buffers grew")
    w.plan_stats["row_planner"] = "kernel"
    return launches_from_desc(w, values, device_ws, host_ws, disable_split_kv)


def launches_from_desc(w: VariantWrapper, values: list[int], device_ws: torch.Tensor, host_ws: torch.Tensor,
                       disable_split_kv: bool) -> list[Launch]:
    """The Launch views of a written plan: ``values`` is the descriptor (HEADER, then
    LAUNCH_FIELDS per launch), the workspace holds what it points at. Every view comes from
    one split of the workspace (a view op costs microseconds of host time)."""
    from .wrapper import Launch

    head = values[:HEADER_FIELDS]
    pages_off, total_pages, n_launches = (head[HeaderField.PAGES_OFFSET], head[HeaderField.TOTAL_PAGES],
                                          head[HeaderField.LAUNCHES])
    w.plan_stats["segments"] = {f.name.lower(): head[f] for f in HeaderField if f >= HeaderField.DENSE}
    ints = device_ws.view(torch.int32)
    rows = [values[HEADER_FIELDS + i * LAUNCH_FIELDS:HEADER_FIELDS + (i + 1) * LAUNCH_FIELDS]
            for i in range(n_launches)]
    # [gap, q_starts, kv_indptr, last_page_len, meta] per launch, a gap, each launch's pages, the rest
    sizes, at = [], 0
    for d in rows:
        n, offset = d[LaunchField.REQUESTS], d[LaunchField.OFFSET] // 4
        sizes += [offset - at, n + 1, n + 1, n, META_COLUMNS * n]
        at = offset + 3 * n + 2 + META_COLUMNS * n
    sizes.append(pages_off // 4 - at)
    page_at = 0
    for d in rows:
        if d[LaunchField.PAGE_AT] != page_at:
            raise LaunchError(f"internal: launch pages at {d[LaunchField.PAGE_AT]}, expected {page_at} (back to back)")
        sizes.append(d[LaunchField.PAGES])
        page_at += d[LaunchField.PAGES]
    sizes.append(ints.numel() - pages_off // 4 - total_pages)
    views = ints.split_with_sizes(sizes)
    float_chunks = w._float_chunks(n_launches)
    launches = []
    for i, d in enumerate(rows):
        mode, window, n, offset, packed, schedule, nrows, _, _, info_len = d[:LaunchField.INFO]
        _, q_starts, kv_indptr, last_page_len, meta = views[5 * i:5 * i + 5]
        int_ws = device_ws
        if schedule == Schedule.FLASHINFER:  # fa2 where KV may be split: FlashInfer's scheduler
            at = offset // 4
            host_ints = host_ws.view(torch.int32)  # plan_qo and kv_indptr of the launch, on the host
            int_ws, plan_info = w._flashinfer_plan(
                i, host_ints[at + 12 * n + 2:at + 13 * n + 3], host_ints[at + n + 1:at + 2 * n + 2], nrows,
                float_chunks[i], disable_split_kv, None if packed else q_starts)
        else:
            plan_info = d[LaunchField.INFO:LaunchField.INFO + info_len]
        launches.append(Launch(
            mask_mode=MaskMode(mode).label, q_starts=q_starts, kv_indptr=kv_indptr,
            kv_indices=views[5 * n_launches + 1 + i], last_page_len=last_page_len,
            meta=meta.view(n, META_COLUMNS), window_left=window, plan_info=plan_info, int_workspace=int_ws,
            float_workspace=float_chunks[i], num_requests=n))
    w.plan_stats["launches"] = [(la.mask_mode, la.num_requests) for la in launches]
    return launches
