"""What may come next in a document a tokenizer wrote: the rules a model's sampled ids
must follow for the tokenizer to decode them.

A model has one head per modality, each over the shared specials and its own range, so
a sampler restricted to one head's ids already gives ids of the right modality. A kind
asks a little more, and says it as data (:meth:`Tokenizer.layout
<ulysses_mm.tokenize.base.Tokenizer.layout>`, a :class:`~ulysses_mm.tokenize.base.Layout`);
:class:`Grammar` applies it at each position, given the ids so far (a prompt, then what
was sampled):

- by default: any id of the range, or ``</doc>`` (the document ends);
- ``quantizers``: the q-th id of each frame from the q-th codebook of ids (a codec's
  quantizers; ids say their codebook), ``</doc>`` only before a frame;
- ``frame``: exactly that many ids per frame, then ``<eof>`` (forced);
- ``ragged``: ids or ``<eof>`` (frames are ragged), ``<eof>`` forced once a frame holds
  ``max_frame`` ids, so a model that never closes a frame still makes frames;
- ``interleave``: after every ``chunk_frames`` frames the other modality's
  ``<|m|>`` is forced, its head then writes that chunk's ids (``seconds_per_chunk`` at
  ``ids_per_second``, edges rounded as the tokenizer cuts them), then the kind's own
  ``<|m|>`` is forced. A prompt with more frames in a chunk than that (a clip without
  the other track) turns the interleaving off.

Torch-free: the sampler applies :class:`Next` to its logits.
"""

from __future__ import annotations

from dataclasses import dataclass

from ulysses_mm.core.tokenspace import BASE_SPECIALS, DOC_END, EOF, TokenSpace
from ulysses_mm.tokenize.base import Tokenizer


@dataclass(frozen=True)
class Next:
    """What the next id may be: ``forced`` (no choice), else an id of ``head``'s range
    ``[lo, hi)`` or one of ``specials``, sampled from ``head``'s logits."""

    head: str
    lo: int = 0
    hi: int = 0
    specials: tuple[int, ...] = ()
    forced: int | None = None


class Grammar:
    """Feed it a document's ids (``<doc> <|m|> …``) one at a time; :meth:`next` says what
    may follow. ``end``: whether ``</doc>`` may be sampled (where the kind allows it)."""

    def __init__(self, tokenizer: Tokenizer, space: TokenSpace, end: bool = True) -> None:
        self.space = space
        self.modality = tokenizer.modality
        r = space.range(self.modality)
        self.lo, self.hi = r.start, r.stop
        self.end = (DOC_END,) if end else ()
        layout = tokenizer.layout(space)
        self.frame = layout.frame or None  # ids per frame of a fixed-frame kind
        self.ragged_frames = layout.ragged
        self.max_frame = layout.max_frame  # ids a ragged frame may reach before <eof> is forced
        self.quantizers = layout.quantizers  # e.g. codec audio
        self.codebook = layout.codebook_size
        self.audio: str | None = None  # the interleaved modality
        if layout.interleave is not None and layout.interleave.modality in space.modalities:
            self.audio = layout.interleave.modality
            a = space.range(self.audio)
            self.audio_lo, self.audio_hi = a.start, a.stop
            self.chunk = layout.interleave.chunk_frames
            self.seconds_per_chunk = layout.interleave.seconds_per_chunk
            self.rate = layout.interleave.ids_per_second
        # state
        self.in_span = ""  # the modality of the current span ("" before <|m|>)
        self.in_frame = 0  # video ids of the unfinished frame
        self.frames_in_chunk = 0
        self.chunks = 0  # chunks of frames done (each followed by its audio)
        self.in_audio = 0  # audio ids of the current chunk's audio so far
        self.ids_in_span = 0

    def _chunk_samples(self, c: int) -> int:
        """Audio samples of chunk ``c``, as the tokenizer cuts them (rounded edges)."""
        t = self.seconds_per_chunk * self.rate
        return round((c + 1) * t) - round(c * t)

    def feed(self, token: int) -> None:
        space = self.space
        if len(BASE_SPECIALS) <= token < space.num_specials:  # <|m|>: a span of m begins
            opened = space.modalities[token - len(BASE_SPECIALS)]
            if opened == self.modality and self.in_span == self.audio and self.audio is not None:
                self.chunks += 1  # back to video after a chunk's audio
                self.frames_in_chunk = 0
            self.in_span, self.ids_in_span = opened, 0
            if opened == self.audio:
                self.in_audio = 0
            return
        if token == EOF and self.in_span == self.modality:
            self.in_frame = 0
            self.frames_in_chunk += 1
            if self.audio is not None and self.frames_in_chunk > self.chunk:
                self.audio = None  # a clip without its other track: no interleaving
            return
        if token < space.num_specials:
            return
        self.ids_in_span += 1
        if self.in_span == self.modality:
            self.in_frame += 1
        elif self.in_span == self.audio:
            self.in_audio += 1

    def next(self) -> Next:
        m = self.modality
        if not self.in_span:
            return Next(m, forced=self.space.boundary_token(m))
        if self.audio is not None:
            if self.in_span == m and self.frames_in_chunk == self.chunk and not self.in_frame:
                return Next(m, forced=self.space.boundary_token(self.audio))
            if self.in_span == self.audio:
                if self.in_audio >= self._chunk_samples(self.chunks):
                    return Next(m, forced=self.space.boundary_token(m))
                return Next(self.audio, self.audio_lo, self.audio_hi)
        if self.frame is not None:
            if self.in_frame == self.frame:
                return Next(m, forced=EOF)
            return Next(m, self.lo, self.hi)
        if self.ragged_frames:
            if self.max_frame and self.in_frame >= self.max_frame:
                return Next(m, forced=EOF)
            return Next(m, self.lo, self.hi, (EOF,))
        if self.quantizers > 1 and self.codebook:
            q = self.ids_in_span % self.quantizers
            lo = self.lo + q * self.codebook
            return Next(m, lo, lo + self.codebook, self.end if q == 0 else ())
        return Next(m, self.lo, self.hi, self.end)
