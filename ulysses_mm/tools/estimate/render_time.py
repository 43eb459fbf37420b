"""A step time as text: the headline line (step, tokens/s, MFU, time to a token budget),
the breakdown of the critical path, and the efficiencies it assumed."""

from __future__ import annotations

from ulysses_mm.tools.estimate.step_time import StepTime


def duration(seconds: float) -> str:
    """``seconds`` in the unit that reads best: ms, s, min, h or days."""
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def rate(n: float) -> str:
    """``n`` with K/M/G, e.g. ``85K``."""
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.3g}"


def count(n: float) -> str:
    """A token count as ``1e9`` or ``2.5e10`` (no ``+`` or leading zero in the exponent)."""
    return f"{n:.3g}".replace("e+0", "e").replace("e+", "e")


def headline(st: StepTime, budget: float | None = None) -> str:
    """``step 12.3 s · 85K tokens/s · MFU 41 % · 1e9 tokens in 3.3 h``."""
    text = (
        f"step {duration(st.step_s)} · {rate(st.tokens_per_s)} tokens/s · MFU {st.mfu:.0%}"
    ).replace("%", " %")
    if budget:
        text += f" · {count(budget)} tokens in {duration(st.time_for(budget))}"
    return text


def render_time(st: StepTime, gpus: int, budget: float | None = None) -> str:
    """The time lines of ``ulysses-mm estimate --time``."""
    lines = [
        f"time      {headline(st, budget)}",
        f"          {gpus} × {st.device}; {st.tokens:,} tokens a step; {st.docs} "
        f"({st.pairs_per_sample:.4g} attention pairs a sample)",
        f"          FLOPs a step {st.model_flops:.3g} (executed, with recomputation: "
        f"{sum(st.executed_flops.values()):.3g})",
        "",
        "  step time on the critical path                 s    before overlap",
    ]
    for name, exposed in st.exposed.items():
        lines.append(f"  {name:<42} {exposed:>9.3f} {st.seconds[name]:>12.3f}")
    comm = sum(st.exposed[k] for k in ("all-to-all", "ring", "dp comm", "offload"))
    lines.append(f"  {'exposed communication':<42} {comm:>9.3f}")
    lines.append(f"  {'step':<42} {st.step_s:>9.3f}")
    lines.append(f"  efficiencies assumed: {st.efficiency.describe()}")
    lines += [f"  note: {n}" for n in st.notes]
    return "\n".join(lines)
