"""The flex route's probe answer has the details keys every backend's has (docs/serving.md has
engines log details["row_planner"] whatever the route)."""

from __future__ import annotations

from variantgen.api import probing
from variantgen.api.probing import probe


def test_the_flex_route_names_its_row_planner(vg_env):
    probing.cache_clear()
    flex = probe("mm_prefix", head_dim_qk=64, q_dtype="fp32", kv_dtype="fp32", backend="flex", device="cpu")
    assert flex, flex.reason
    assert flex.details["backend"] == "flex"
    assert flex.details["row_planner"] == ("none needed: the flex route has no planner module (plan() builds its "
                                           "block mask in torch)")
