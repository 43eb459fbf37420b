"""Commands that check a setup before it runs (verify, config; estimate's arguments are
:class:`ulysses_mm.tools.estimate.options.EstimateArgs`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ulysses_mm.config import (
    RunConfig,
    deep_merge,
    describe,
    from_dict,
    load_config,
    parse_overrides,
    read_yaml,
    to_dict,
)
from ulysses_mm.config.parse import option, overrides
from ulysses_mm.core.checks import MAX_PROCESSES


@dataclass
class Verify:
    """Run forward+backward of a small model on random packed multimodal data once with
    dp × sp processes (Ulysses) and once as a single process; print the loss and every
    gradient's max difference and the all-to-all bytes per layer. Starts its own
    processes, or joins the world of torchrun / the DeepSpeed launcher."""

    sp: int | None = option(
        "sequence-parallel size P (parallel.sp=P)", None, ge=1, le=MAX_PROCESSES
    )
    dp: int | None = option(
        "data-parallel size D (parallel.dp=D; default: 1, or the launched world / P)", None,
        ge=0, le=MAX_PROCESSES,
    )  # fmt: skip
    ring: int | None = option(
        "ring size R inside sp (parallel.ring=R): Ulysses over sp/R ranks × a ring of R", None,
        ge=1, le=MAX_PROCESSES,
    )  # fmt: skip
    config: str | None = option(
        "run config YAML or a shipped config's name (default: the schema's defaults)", None,
        path="run_config",
    )  # fmt: skip
    overrides: list[str] = overrides()

    def main(self, opts: Any) -> int:
        from ulysses_mm.tools.verify import verify_against_one_process  # lazy: torch

        layout = [f"parallel.{k}={getattr(self, k)}" for k in ("sp", "dp", "ring")]
        layout = [x for x in layout if not x.endswith("=None")]
        return verify_against_one_process(
            load_config(RunConfig, self.config, [*layout, *self.overrides]), opts
        )


@dataclass
class Config:
    """Print the resolved run config (with --from-hf, the model section that matches a
    transformers checkpoint), or every key with its type, valid range and help (--keys)."""

    config: str | None = option(
        "run config YAML or a shipped config's name", None, path="run_config", positional=True
    )
    overrides: list[str] = overrides()
    keys: bool = option("list every config key with its type, valid range and help", False)
    from_hf: str | None = option(
        "fill the model section from a transformers Llama/Qwen2/Qwen3 checkpoint "
        "(architecture, init_from=DIR, the text modality sized to its vocabulary); overrides "
        "still win", None, path="in_dir", metavar="DIR",
    )  # fmt: skip

    def main(self) -> int:
        import yaml  # lazy: only this command prints YAML

        if self.keys:
            for key, tp, valid, text in describe(RunConfig):
                print(f"{key:<40s} {tp:<24s} {valid or '-':<16s} {text}")
            return 0
        if self.from_hf:
            from ulysses_mm.model.hf_import import model_section  # lazy: torch

            # defaults < file < the checkpoint's model section < overrides
            data = read_yaml(self.config) if self.config else {}
            data["model"] = model_section(self.from_hf, data.get("model"))
            cfg = from_dict(RunConfig, deep_merge(data, parse_overrides(self.overrides)))
        else:
            cfg = load_config(RunConfig, self.config, self.overrides)
        out = to_dict(cfg)
        # the RoPE keys its kind leaves unset and the settings a stage keeps are left out
        out["model"]["rope"] = _set_only(out["model"]["rope"])
        out["train"]["stages"] = [_set_only(stage) for stage in out["train"]["stages"]]
        print(yaml.safe_dump(out, sort_keys=False), end="")
        return 0


def _set_only(section: dict) -> dict:
    """``section`` without its None values (nested sections too; an emptied one goes)."""
    out = {}
    for key, value in section.items():
        if isinstance(value, dict):
            value = _set_only(value)
        if value is not None and value != {}:
            out[key] = value
    return out
