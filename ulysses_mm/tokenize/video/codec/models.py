"""The neural video tokenizers ``video-codec`` runs, read from a local directory (never
downloaded), each behind the same four numbers and two calls.

- ``emu3``: transformers' ``Emu3VQVAE`` (``config.json`` of ``model_type``
  ``emu3_vqgan`` and its weights, as ``save_pretrained`` writes them): 32,768 codes,
  4× temporal and 8× spatial compression in the released model. Input
  ``[b, t, 3, H, W]`` in [-1, 1], ``t`` a multiple of the temporal factor.
- ``cosmos``: Cosmos DV's TorchScript files ``encoder.jit`` and ``decoder.jit`` (e.g.
  DV8x16x16: 64,000 codes, 8× temporal, 16× spatial, causal: ``1 + k·8`` frames give
  ``1 + k`` latent steps). ``encoder(video [b, 3, t, H, W] in [-1, 1])`` gives
  ``(indices [b, t', H/s, W/s], codes)``, ``decoder(indices)`` the video back.
  TorchScript files are programs: load only files you trust, as with any checkpoint.

Shapes in the calls below: ``frames [t, H, W, 3]`` uint8 in, ``ids [t', h, w]`` int64
out, and back.

The weights load on first use (a spec is read by commands that never code a frame), but
what can be checked without loading them is checked when the codec is opened, so a fault
is one line naming the directory and the file, once, before any input is decoded: the
device (a GPU the spec names is there), ``config.json`` (JSON of an Emu3VQVAE), the weight
files (a safetensors header that reads, TorchScript archives). A load that still fails is
the same one line.
"""

from __future__ import annotations

import json
import re
import zipfile
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

from ulysses_mm.core.errors import DataError, UnsupportedError, first_line

FORMATS = ("emu3", "cosmos")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_device(where: str, device: str) -> None:
    """``params.device`` names a device this process has: ``auto``, ``cpu``, or a CUDA
    device torch sees (one line naming the spec otherwise, before anything is decoded)."""
    if not _DEVICE.fullmatch(device):
        raise DataError(f"{where}: params.device {device!r} must be auto, cpu, cuda or cuda:N")
    if not device.startswith("cuda"):
        return
    import torch  # lazy: only a spec that names a GPU needs torch to check for it

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        have = f"{count} CUDA device(s)" if count else "no CUDA device"
        if torch.version.cuda is None:
            have += f" (torch {torch.__version__} is built without CUDA)"
        raise UnsupportedError(
            f"{where}: params.device is {device!r} but this machine has {have}; set "
            "params.device to auto (a GPU where there is one) or cpu"
        )


class VideoCodec(ABC):
    """A discrete video autoencoder: ``latents(t)`` steps of ``[h, w]`` ids for ``t``
    frames."""

    temporal: int  # frames per latent step (a causal codec's first step holds one)
    spatial: int  # pixels per id along each side
    codebook: int  # ids 0..codebook-1
    causal: bool  # the first latent step codes the first frame alone

    def __init__(self, where: str, path: Path, device: str, dtype: str) -> None:
        self.where, self.path = where, path
        self.device_name, self.dtype_name = device, dtype
        self._loaded = False

    def latents(self, frames: int) -> int:
        """Latent steps for ``frames`` frames (a whole number of steps)."""
        return 1 + (frames - 1) // self.temporal if self.causal else frames // self.temporal

    def frames(self, latents: int) -> int:
        """Frames decoded from ``latents`` steps."""
        return 1 + (latents - 1) * self.temporal if self.causal else latents * self.temporal

    def whole(self, frames: int) -> bool:
        """Whether ``frames`` frames make whole latent steps."""
        return frames >= 1 and self.frames(self.latents(frames)) == frames

    def _torch(self) -> tuple[Any, Any, Any]:
        import torch  # lazy: tokenize/ stays torch-free until a frame is coded

        device = self.device_name
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        return torch, torch.device(device), getattr(torch, self.dtype_name)

    def encode(self, frames: np.ndarray) -> np.ndarray:
        """uint8 frames [t, H, W, 3] (whole latent steps) -> int64 ids [t', H/s, W/s]."""
        torch, device, dtype = self._torch()
        self._load()
        x = torch.from_numpy(np.ascontiguousarray(frames)).to(device=device, dtype=torch.float32)
        x = (x / 127.5 - 1.0).permute(0, 3, 1, 2).unsqueeze(0).to(dtype)  # [1, t, 3, H, W]
        with torch.inference_mode():
            ids = self._encode(x)
        out = ids.reshape(ids.shape[-3:]).to("cpu", torch.int64).numpy()
        t, h, w = frames.shape[0], frames.shape[1], frames.shape[2]
        want = (self.latents(t), h // self.spatial, w // self.spatial)
        if out.shape != want:
            raise DataError(
                f"{self.where}: the {type(self).__name__} in {self.path} gave ids of shape "
                f"{list(out.shape)} for {t} frames of {h}×{w}, the spec's factors say {list(want)}"
            )
        if out.size and (out.min() < 0 or out.max() >= self.codebook):
            raise DataError(
                f"{self.where}: the codec in {self.path} gave id {int(out.max())}, outside its "
                f"{self.codebook} codes (vocab_size)"
            )
        return out

    def decode(self, ids: np.ndarray) -> np.ndarray:
        """int64 ids [t', h, w] -> uint8 frames [frames(t'), h·s, w·s, 3]."""
        torch, device, _ = self._torch()
        self._load()
        z = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)).to(device).unsqueeze(0)
        with torch.inference_mode():
            x = self._decode(z)  # [1, t, 3, H, W], about [-1, 1]
        x = ((x[0].float().clamp(-1.0, 1.0) + 1.0) * 127.5).round()
        return x.permute(0, 2, 3, 1).to("cpu", torch.uint8).numpy()

    def _load(self) -> None:
        if not self._loaded:
            try:
                self._open()
            except DataError:
                raise
            except Exception as e:  # the files' fault (what loads them is a few lines)
                raise DataError(
                    f"{self.where}: cannot load the {type(self).__name__} in {self.path} "
                    f"({first_line(e)})"
                ) from None
            self._loaded = True

    @abstractmethod
    def _open(self) -> None:
        """Load the weights (on first use: a spec is checked without them)."""

    @abstractmethod
    def _encode(self, x: Any) -> Any:
        """[1, t, 3, H, W] in [-1, 1] -> ids [1, t', h, w]."""

    @abstractmethod
    def _decode(self, ids: Any) -> Any:
        """ids [1, t', h, w] -> [1, t, 3, H, W] in about [-1, 1]."""


class Emu3Codec(VideoCodec):
    """transformers' ``Emu3VQVAE`` from ``save_pretrained``'s directory."""

    causal = False

    def __init__(self, where: str, path: Path, device: str, dtype: str) -> None:
        super().__init__(where, path, device, dtype)
        config = path / "config.json"
        try:
            cfg = json.loads(config.read_text())
        except OSError as e:
            raise DataError(f"{where}: cannot read {config}: {e.strerror or e}") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(f"{where}: {config} is not JSON ({first_line(e)})") from None
        kind = cfg.get("model_type") if isinstance(cfg, dict) else None
        if kind != "emu3_vqgan":
            raise DataError(
                f"{where}: {config} is model_type {kind!r}; format 'emu3' reads an Emu3VQVAE "
                "(model_type 'emu3_vqgan', e.g. the vq model saved on its own)"
            )
        temporal = cfg.get("temporal_downsample_factor", 4)
        levels = cfg.get("channel_multiplier", (1, 2, 2, 4))
        codebook = cfg.get("codebook_size", 32768)
        for key, value in (("temporal_downsample_factor", temporal), ("codebook_size", codebook)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise DataError(f"{where}: {config}: {key} must be an integer >= 1, got {value!r}")
        if not isinstance(levels, (list, tuple)) or not levels:
            raise DataError(f"{where}: {config}: channel_multiplier must be a list, got {levels!r}")
        self.temporal, self.spatial, self.codebook = temporal, 2 ** (len(levels) - 1), codebook
        _check_safetensors(where, path)
        self.model: Any = None

    def _open(self) -> None:
        """The Emu3VQVAE, every tensor of it from the directory: transformers' progress bar
        and load report held back, a tensor it lacks refused (transformers would start it
        from random values and only say so in its report)."""
        from transformers import Emu3VQVAE  # lazy: transformers and torch, on first use
        from transformers.utils import logging as hf_logging  # lazy: as above

        _, device, dtype = self._torch()
        bar, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
        try:
            loaded: Any = Emu3VQVAE.from_pretrained(
                str(self.path), local_files_only=True, output_loading_info=True
            )
            model, info = loaded  # (the model, what loaded and what did not)
        finally:
            hf_logging.set_verbosity(verbosity)
            if bar:
                hf_logging.enable_progress_bar()
        missing = list(info.get("missing_keys") or [])
        if missing:
            raise DataError(
                f"{self.where}: the weights in {self.path} lack {len(missing)} tensor(s) of "
                f"its config.json's Emu3VQVAE ({sorted(missing)[0]}, …)"
            )
        self.model = model.to(device=device, dtype=dtype).eval()

    def _encode(self, x: Any) -> Any:
        import torch  # lazy: as in _torch

        h, w = x.shape[-2:]
        sizes = torch.tensor([[h, w]], device=x.device)
        return self.model.encode(x, image_sizes=sizes).image_tokens[0]

    def _decode(self, ids: Any) -> Any:
        return self.model.decode(ids)


class CosmosCodec(VideoCodec):
    """Cosmos DV's ``encoder.jit`` / ``decoder.jit``; factors and codes from the spec
    (TorchScript files carry no config)."""

    causal = True

    def __init__(
        self,
        where: str,
        path: Path,
        device: str,
        dtype: str,
        temporal: int,
        spatial: int,
        codebook: int,
    ) -> None:
        super().__init__(where, path, device, dtype)
        for name in ("encoder.jit", "decoder.jit"):
            f = path / name
            if not f.is_file():
                raise DataError(f"{where}: format 'cosmos' needs {f} (not found)")
            if not _is_torchscript(f):
                raise DataError(
                    f"{where}: {f} is not a TorchScript archive (torch.jit.save writes one)"
                )
        self.temporal, self.spatial, self.codebook = temporal, spatial, codebook
        self.encoder: Any = None
        self.decoder: Any = None

    def _open(self) -> None:
        torch, device, _ = self._torch()
        self.encoder = torch.jit.load(str(self.path / "encoder.jit"), map_location=device).eval()
        self.decoder = torch.jit.load(str(self.path / "decoder.jit"), map_location=device).eval()

    def _encode(self, x: Any) -> Any:
        out = self.encoder(x.permute(0, 2, 1, 3, 4))  # Cosmos takes [b, 3, t, H, W]
        return out[0] if isinstance(out, (tuple, list)) else out  # (indices, codes)

    def _decode(self, ids: Any) -> Any:
        return self.decoder(ids).permute(0, 2, 1, 3, 4)  # [b, 3, t, H, W] -> [b, t, 3, H, W]


def _is_torchscript(f: Path) -> bool:
    """Whether ``f`` is a TorchScript archive: a zip holding ``data.pkl`` and
    ``constants.pkl`` (its entries are read, nothing is unpickled)."""
    try:
        with zipfile.ZipFile(f) as z:
            names = {n.rsplit("/", 1)[-1] for n in z.namelist()}
    except (OSError, zipfile.BadZipFile):
        return False
    return {"data.pkl", "constants.pkl"} <= names


def _check_safetensors(where: str, path: Path) -> None:
    """The Emu3VQVAE's weight files in ``path`` (``model.safetensors``, or those an index
    names) each have a safetensors header that reads and fits the file (nothing else is
    read); a directory with neither is refused."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({path / str(f) for f in weight_map.values()})
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
            raise DataError(f"{where}: {index} is not a safetensors index") from None
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        raise DataError(
            f"{where}: {path} has no model.safetensors (the weights save_pretrained writes)"
        )
    for f in files:
        try:
            with safe_open(str(f), framework="numpy"):
                pass
        except (SafetensorError, OSError) as e:
            raise DataError(
                f"{where}: {f} is not a readable safetensors file ({first_line(e)})"
            ) from None


def open_codec(where: str, spec_dir: Path, params: dict[str, Any], codebook: int) -> VideoCodec:
    """The codec a ``video-codec`` spec names (``params.model`` relative to the spec),
    checked as far as it can be without loading its weights."""
    path = Path(params["model"]).expanduser()
    path = path if path.is_absolute() else (spec_dir / path)
    if not path.is_dir():
        raise DataError(f"{where}: params.model {params['model']!r} is not a directory ({path})")
    device, dtype = params["device"], params["dtype"]
    check_device(where, device)
    if params["format"] == "emu3":
        return Emu3Codec(where, path, device, dtype)
    return CosmosCodec(
        where, path, device, dtype, int(params["temporal"]), int(params["spatial"]), codebook
    )
