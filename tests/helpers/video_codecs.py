"""Tiny neural video tokenizers for tests, written where a test asks (nothing downloaded):
a random transformers ``Emu3VQVAE`` saved with ``save_pretrained``, and a TorchScript
stand-in with Cosmos DV's interface (``encoder.jit`` / ``decoder.jit``), a causal FSQ of
the clip's colours averaged over ``temporal`` frames and ``spatial``² pixels."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F


def write_emu3(out: Path, codebook: int = 256, seed: int = 0) -> Path:
    """A random Emu3VQVAE (4× temporal, 8× spatial, ``codebook`` codes) in ``out``."""
    from transformers import Emu3VQVAE, Emu3VQVAEConfig

    cfg = Emu3VQVAEConfig(
        codebook_size=codebook,
        embed_dim=4,
        latent_channels=4,
        base_channels=32,
        channel_multiplier=(1, 1, 1, 1),
        num_res_blocks=1,
        attn_resolutions=(),
        temporal_downsample_factor=4,
        hidden_size=32,
        num_attention_heads=1,
    )
    torch.manual_seed(seed)
    Emu3VQVAE(cfg).eval().save_pretrained(str(out))
    return out


class _Encoder(nn.Module):
    def __init__(self, temporal: int, spatial: int, levels: int) -> None:
        super().__init__()
        self.temporal, self.spatial, self.levels = temporal, spatial, levels

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x [b, 3, t, H, W] in [-1, 1], t = 1 + k·temporal -> ids [b, 1 + k, H/s, W/s]
        b, c, t, h, w = x.shape
        rest = x[:, :, 1:].reshape(b, c, (t - 1) // self.temporal, self.temporal, h, w).mean(3)
        z = torch.cat([x[:, :, :1], rest], 2)
        z = F.avg_pool3d(z, (1, self.spatial, self.spatial))
        q = torch.round((z.clamp(-1.0, 1.0) + 1.0) / 2.0 * (self.levels - 1)).long()
        n = self.levels
        return q[:, 0] * n * n + q[:, 1] * n + q[:, 2], q.float()


class _Decoder(nn.Module):
    def __init__(self, temporal: int, spatial: int, levels: int) -> None:
        super().__init__()
        self.temporal, self.spatial, self.levels = temporal, spatial, levels

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids [b, t', h, w] -> [b, 3, 1 + (t' - 1)·temporal, h·s, w·s] in [-1, 1]
        n = self.levels
        q = torch.stack([ids // (n * n), ids // n % n, ids % n], 1).float()
        z = q / (n - 1) * 2.0 - 1.0
        frames = torch.cat([z[:, :, :1], z[:, :, 1:].repeat_interleave(self.temporal, 2)], 2)
        return frames.repeat_interleave(self.spatial, 3).repeat_interleave(self.spatial, 4)


def write_cosmos(out: Path, temporal: int = 4, spatial: int = 8, levels: int = 8) -> Path:
    """``encoder.jit`` and ``decoder.jit`` with Cosmos DV's interface (``levels``³ codes)."""
    out.mkdir(parents=True, exist_ok=True)
    torch.jit.script(_Encoder(temporal, spatial, levels)).save(str(out / "encoder.jit"))
    torch.jit.script(_Decoder(temporal, spatial, levels)).save(str(out / "decoder.jit"))
    return out


def write_spec(path: Path, model: Path, vocab: int, **params: object) -> Path:
    """A ``video-codec`` spec at ``path`` naming ``model`` (relative to the spec)."""
    spec = {
        "name": path.stem,
        "modality": "video",
        "kind": "video-codec",
        "vocab_size": vocab,
        "params": {"model": str(model.relative_to(path.parent)), **params},
    }
    path.write_text(json.dumps(spec, indent=1) + "\n")
    return path
