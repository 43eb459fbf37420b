"""Which process layouts work: the :class:`Layout` value (dp, sp, ring size, head groups)
built once from the config, and the one check of it against the model's heads and the
sequence length that every caller uses — the parent before it starts processes, Ulysses
attention, the loader's slice and the estimate — so that a refused layout reads the same
everywhere and lists the sp sizes that would work.

Ulysses needs sp to divide the query heads (each rank runs attention on hq/sp of them) and
the sequence (each rank holds N/sp tokens); the world is dp × sp. Key/value heads never
limit sp: with fewer than sp (or a count sp does not divide) they are replicated to
lcm(hk, sp), which divides hq whenever sp and hk both do (see :mod:`ulysses_mm.parallel.ulysses`).

Hybrid Ulysses × ring (``ring_size`` = R > 1, :mod:`ulysses_mm.parallel.ring`): sp = U × R
with U = sp / R Ulysses ranks; only U must divide the heads, and the sequence is cut into
2·sp pieces (2R zigzag chunks, each split over U), so sp is not bounded by the heads.

Head groups (``head_groups`` = C > 1, :mod:`ulysses_mm.parallel.head_groups`): each rank
runs attention on its hq/U query heads in C groups, so C must divide hq/U; the e/U
key/value heads of a rank either split evenly over the groups (C divides e/U) or each group
takes the one kv head its query heads read (e/U divides C).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ulysses_mm.core.errors import UserError


class LayoutError(UserError, ValueError):
    """A process layout that cannot run; the message says what would."""


def valid_sp_sizes(
    num_heads: int | None = None,
    seq_len: int | None = None,
    world: int | None = None,
    limit: int = 1024,
    ring: int = 1,
) -> list[int]:
    """The sp sizes that divide every constraint given (heads, sequence, world); with a
    ring R > 1, the sp = U × R (U divides the heads, 2·sp divides the sequence)."""
    if ring > 1:
        bounds = [n for n in (seq_len, world) if n is not None] + [limit]
        return [
            p
            for p in range(ring, max(1, min(bounds)) + 1, ring)
            if (num_heads is None or num_heads % (p // ring) == 0)
            and (seq_len is None or seq_len % (2 * p) == 0)
            and (world is None or world % p == 0)
        ]
    bounds = [n for n in (num_heads, seq_len, world) if n is not None] + [limit]
    return [
        p
        for p in range(1, max(1, min(bounds)) + 1)
        if all(n is None or n % p == 0 for n in (num_heads, seq_len, world))
    ]


def expanded_kv_heads(num_heads: int, num_kv_heads: int, sp: int) -> int:
    """kv heads after replication so that they split evenly over ``sp`` ranks."""
    e = math.lcm(num_kv_heads, sp)
    assert num_heads % e == 0, (num_heads, num_kv_heads, sp)
    return e


def valid_head_groups(num_heads: int, num_kv_heads: int, ulysses: int) -> list[int]:
    """The head groups C that work for ``ulysses`` = U Ulysses ranks: C divides the hq/U
    query heads of a rank, and its e/U kv heads (e = lcm(hk, U)) split evenly over the C
    groups or each group's query heads read one kv head."""
    if num_heads % ulysses or num_heads % num_kv_heads:
        return []
    local = num_heads // ulysses
    kv = math.lcm(num_kv_heads, ulysses) // ulysses
    return [c for c in range(1, local + 1) if local % c == 0 and (kv % c == 0 or c % kv == 0)]


def head_group_sizes(
    num_heads: int, num_kv_heads: int, ulysses: int, groups: int
) -> tuple[int, int]:
    """(hg, eg): the query heads and the kv heads (of e = lcm(hk, U) after replication)
    one of ``groups`` = C groups holds on one of ``ulysses`` = U ranks: hq/(U·C), and
    e/(U·C) when C divides the rank's e/U kv heads, else the one kv head its query heads
    read."""
    el = math.lcm(num_kv_heads, ulysses) // ulysses
    return num_heads // ulysses // groups, el // groups if el % groups == 0 else 1


def check_head_groups(head_groups: int, num_heads: int, num_kv_heads: int, ulysses: int) -> None:
    """Refuse, in one line, head groups that do not split a rank's heads evenly."""
    if head_groups < 1:
        raise LayoutError(f"head_groups must be >= 1, got {head_groups}")
    works = valid_head_groups(num_heads, num_kv_heads, ulysses)
    if head_groups not in works:
        kv = math.lcm(num_kv_heads, ulysses) // ulysses
        raise LayoutError(
            f"head_groups={head_groups} does not split the {num_heads // ulysses} query heads "
            f"and {kv} kv heads each of the {ulysses} Ulysses rank{'s' if ulysses > 1 else ''} "
            f"holds into equal groups; head_groups that do: {works}"
        )


@dataclass(frozen=True)
class Layout:
    """How the processes of a run are laid out, as sizes: ``dp`` data-parallel replicas of
    an SP group of ``sp`` = U × R ranks (U = :attr:`ulysses_size` Ulysses ranks times a
    ring of R = ``ring_size``), attention in ``head_groups`` groups of heads. Built once
    from the config (:meth:`from_config`), held by the mesh and the estimate's step shape,
    compared by equality when a stage changes it. Building one refuses sizes that cannot
    form a layout; :meth:`check` refuses a model shape or length it cannot split."""

    dp: int = 1
    sp: int = 1
    ring_size: int = 1
    head_groups: int = 1

    def __post_init__(self) -> None:
        if self.dp < 1:
            raise LayoutError(f"dp must be >= 1, got {self.dp}")
        _refuse(self.sp, self.dp, self.ring_size, self.head_groups)

    @property
    def ulysses_size(self) -> int:
        """U = sp / R: the ranks of one Ulysses all-to-all."""
        return self.sp // self.ring_size

    @property
    def world_size(self) -> int:
        return self.dp * self.sp

    @classmethod
    def resolve(
        cls,
        world_size: int,
        sp: int = 1,
        dp: int = 0,
        ring_size: int = 1,
        head_groups: int = 1,
        *,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        seq_len: int | None = None,
    ) -> Layout:
        """The layout that fills a world of ``world_size`` processes (dp 0 = world / sp).
        The model's facts, when given, are checked with the world at once, so that a
        refusal lists the sp sizes that fit both."""
        _refuse(sp, dp, ring_size, head_groups, world_size, num_heads, num_kv_heads, seq_len)
        return cls(dp=dp or world_size // sp, sp=sp, ring_size=ring_size, head_groups=head_groups)

    @classmethod
    def from_config(
        cls,
        parallel: Any,
        world_size: int,
        *,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        seq_len: int | None = None,
    ) -> Layout:
        """:meth:`resolve` for a config's ``parallel`` section (sp, dp, ring, head_groups)."""
        return cls.resolve(
            world_size,
            parallel.sp,
            parallel.dp,
            parallel.ring,
            parallel.head_groups,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            seq_len=seq_len,
        )

    def check(
        self,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        seq_len: int | None = None,
    ) -> Layout:
        """Refuse, in one line listing what would work, a model shape (query and kv heads)
        or a sequence length this layout cannot split; only the facts given are checked.
        The sp sizes listed are those the facts allow (the world, which a built layout
        fills, is :meth:`resolve`'s to check). Returns the layout."""
        _refuse(
            self.sp, 0, self.ring_size, self.head_groups, None, num_heads, num_kv_heads, seq_len
        )
        return self

    def describe(self) -> str:
        text = f"dp={self.dp} × sp={self.sp}"
        if self.ring_size > 1:
            text += f" (ulysses {self.ulysses_size} × ring {self.ring_size})"
        if self.head_groups > 1:
            text += f", {self.head_groups} head groups"
        return text


def _refuse(
    sp: int,
    dp: int,
    ring: int,
    head_groups: int,
    world: int | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    seq_len: int | None = None,
) -> None:
    """Refuse a layout that cannot run, in one line; only the facts given are checked
    (``dp`` 0: world / sp). ``ring`` = R: sp = U × R, U = sp / R must divide the heads
    and, when R > 1, 2·sp the sequence; ``head_groups`` = C must split each rank's heads
    (:func:`valid_head_groups`)."""
    if sp < 1:
        raise LayoutError(f"sp must be >= 1, got {sp}")
    if ring < 1:
        raise LayoutError(f"ring must be >= 1, got {ring}")
    if dp < 0:
        raise LayoutError(f"dp must be >= 0, got {dp}")
    if head_groups < 1:
        raise LayoutError(f"head_groups must be >= 1, got {head_groups}")
    if sp % ring:
        raise LayoutError(
            f"ring={ring} does not divide sp={sp}; sp = ulysses × ring, sp sizes that work: "
            f"{valid_sp_sizes(num_heads, seq_len, world, ring=ring)}"
        )
    if num_heads is not None and num_kv_heads is not None and num_heads % num_kv_heads:
        raise LayoutError(
            f"the {num_heads} query heads are not a multiple of the {num_kv_heads} key/value heads"
        )
    u = sp // ring
    what = []
    if ring == 1:
        if num_heads is not None and num_heads % sp:
            what.append(f"the {num_heads} query heads")
        if seq_len is not None and (seq_len < sp or seq_len % sp):
            what.append(f"the sequence of {seq_len} tokens")
        if world is not None and world % sp:
            what.append(f"the world of {world} processes")
        if what:
            raise LayoutError(
                f"sp={sp} does not divide {' and '.join(what)}; sp sizes that do: "
                f"{valid_sp_sizes(num_heads, seq_len, world)}"
            )
    else:
        if num_heads is not None and num_heads % u:
            what.append(f"ulysses={u} (sp / ring) does not divide the {num_heads} query heads")
        if seq_len is not None and seq_len % (2 * sp):
            what.append(
                f"2·sp={2 * sp} (2·ring zigzag chunks over ulysses={u}) does not divide the "
                f"sequence of {seq_len} tokens"
            )
        if world is not None and world % sp:
            what.append(f"sp={sp} does not divide the world of {world} processes")
        if what:
            raise LayoutError(
                f"sp={sp} with ring={ring}: {' and '.join(what)}; sp sizes that work with "
                f"ring={ring}: {valid_sp_sizes(num_heads, seq_len, world, ring=ring)}"
            )
    if head_groups != 1 and num_heads is not None and num_kv_heads is not None:
        check_head_groups(head_groups, num_heads, num_kv_heads, u)
    if world is not None and dp and dp * sp != world:
        raise LayoutError(f"dp={dp} × sp={sp} = {dp * sp} but the world has {world} processes")
