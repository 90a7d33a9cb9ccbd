"""make_copy.py KIND DEST: a copy of the package (run from the repository root, at a commit before
59d9ab6, whose fa2 variant had one struct for every launch) with fa2's variant mask changed:

    base           as it is
    maskfree       LogitsMask returns true (FlashInfer's DefaultAttention without a window)
    maskfree_qlen  and PagedParams::get_qo_len from q_indptr, as FlashInfer's own params
    window         only the kernel window check
    select         the known-range check, the window and the spec's mask without a branch
    noinline       the spec's mask in a __noinline__ member function

Only the causal spec's launches (exact: every key known visible) run right in every copy."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

WINDOW = "kv_idx + qo_len + window_left >= kv_len + qo_idx"
SPEC_MASK = """{% if mask_locals %}
{{ mask_locals }}
{% endif %}
    return {{ mask_code | indent(8) }};
"""


def member(inline: str) -> str:
    """The spec's mask as a member function (``inline``: its CUDA inlining attribute)."""
    return ("  template <typename Params>\n  __device__ " + inline + " bool SpecMask(const Params& params,"
            " uint32_t batch_idx, uint32_t qo_idx, uint32_t kv_idx, uint32_t qo_head_idx, uint32_t kv_head_idx)"
            " const {\n" + SPEC_MASK + "  }\n")


HOOK = "  REGISTER_LOGITS_MASK(params, batch_idx, qo_idx, kv_idx, qo_head_idx, kv_head_idx, {{\n{body}  }})\n"
KNOWN = "    const int32_t vg_key = kv_pos_base + int32_t(kv_idx);\n"
CALL = "SpecMask(params, batch_idx, qo_idx, kv_idx, qo_head_idx, kv_head_idx)"

MASKS = {
    "maskfree": HOOK.format(body="    return true;\n"),
    "maskfree_qlen": HOOK.format(body="    return true;\n"),
    "window": HOOK.format(body=f"    return {WINDOW};\n"),
    "select": member("__forceinline__") + HOOK.format(body=(
        KNOWN + "    const bool known = uint32_t(vg_key - vis_lo) <= uint32_t(vis_hi - vis_lo);\n"
        f"    const bool spec = {CALL};\n    return ({WINDOW}) && (known || spec);\n")),
    "noinline": member("__noinline__") + HOOK.format(body=(
        KNOWN + f"    if (vg_key >= vis_lo && vg_key <= vis_hi) return {WINDOW};\n    return {CALL};\n")),
}


def main() -> None:
    kind, dest = sys.argv[1], Path(sys.argv[2])
    for part in ("variantgen", "templates", "specs", "bench"):
        shutil.copytree(part, dest / part, dirs_exist_ok=True)
    shutil.copy("pyproject.toml", dest)
    if kind in MASKS:
        path = dest / "templates/fa2/variant.cuh.jinja"
        text = path.read_text()
        start = text.index("  REGISTER_LOGITS_MASK(params")
        end = text.index("  })\n", start) + len("  })\n")
        path.write_text(text[:start] + MASKS[kind] + text[end:])
    if kind == "maskfree_qlen":
        path = dest / "templates/fa2/config.inc.jinja"
        text = path.read_text()
        start = text.index("  // The launch request's query count comes from vg_meta")
        end = text.index("  }\n", start) + len("  }\n")
        path.write_text(text[:start] + "  __host__ __device__ __forceinline__ uint32_t get_qo_len(uint32_t b) const {"
                        " return q_indptr[b + 1] - q_indptr[b]; }\n" + text[end:])
    elif kind not in MASKS and kind != "base":
        raise SystemExit(f"unknown kind {kind!r}: expected base, maskfree_qlen or one of {sorted(MASKS)}")


if __name__ == "__main__":
    main()
