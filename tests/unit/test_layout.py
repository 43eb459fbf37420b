"""The Layout value: its derived sizes, its one-line refusals, equality, and the old
config key that still reads."""

from __future__ import annotations

import pytest

from ulysses_mm.config import RunConfig, load_config
from ulysses_mm.core.layout import Layout, LayoutError


def test_derived_sizes_and_resolution():
    lay = Layout.resolve(16, 8, ring_size=2, head_groups=4)
    assert (lay.dp, lay.sp, lay.ulysses_size, lay.ring_size, lay.world_size) == (2, 8, 4, 2, 16)
    assert lay.head_groups == 4
    assert Layout.resolve(8, 2, dp=4) == Layout(dp=4, sp=2)


def test_equality_is_what_a_stage_change_compares():
    assert Layout(dp=2, sp=2) == Layout(dp=2, sp=2)
    assert Layout(dp=2, sp=2) != Layout(dp=2, sp=2, head_groups=2)
    assert Layout(dp=1, sp=4) != Layout(dp=1, sp=4, ring_size=2)


def test_refusals_are_one_line_listing_what_works():
    with pytest.raises(LayoutError, match=r"^ring=3 does not divide sp=4; .*$"):
        Layout(sp=4, ring_size=3)
    with pytest.raises(LayoutError, match=r"^dp must be >= 1, got 0$"):
        Layout(dp=0)
    with pytest.raises(LayoutError, match=r"^head_groups must be >= 1, got 0$"):
        Layout(head_groups=0)
    with pytest.raises(
        LayoutError,
        match=r"^sp=3 does not divide the 8 query heads; sp sizes that do: \[1, 2, 4, 8\]$",
    ):
        Layout(sp=3).check(num_heads=8)
    with pytest.raises(LayoutError, match=r"head_groups=3 .* head_groups that do: \[1, 2, 4\]$"):
        Layout(sp=8, head_groups=3).check(num_heads=32, num_kv_heads=8)
    msg = "sp=6 does not divide the 32 query heads and the world of 8 processes"
    with pytest.raises(LayoutError, match=msg):
        Layout.resolve(8, 6, num_heads=32)


def test_from_config_and_the_old_head_chunks_key():
    cfg = load_config(RunConfig, None, ["parallel.sp=2", "parallel.head_groups=2"])
    assert Layout.from_config(cfg.parallel, 4) == Layout(dp=2, sp=2, head_groups=2)
    with pytest.warns(FutureWarning, match=r"'parallel.head_chunks' is now 'parallel.head_groups'"):
        old = load_config(RunConfig, None, ["parallel.head_chunks=2"])
    assert old.parallel.head_groups == 2
