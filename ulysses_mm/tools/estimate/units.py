"""The byte units the estimate's figures are printed in."""

from __future__ import annotations

GiB = 1 << 30
MiB = 1 << 20


def unit_for(total: int) -> tuple[float, str]:
    """(divisor, name) of the unit a figure of ``total`` bytes is printed in."""
    return (GiB, "GiB") if total >= GiB else (MiB, "MiB")


def size_text(n: int) -> str:
    """``n`` bytes as text in its unit, e.g. ``1.50 GiB``."""
    div, unit = unit_for(n)
    return f"{n / div:.2f} {unit}"
