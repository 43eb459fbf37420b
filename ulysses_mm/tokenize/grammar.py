"""What may come next in a document a tokenizer wrote: the rules a model's sampled ids
must follow for the tokenizer to decode them.

A model has one head per modality, each over the shared specials and its own range, so
a sampler restricted to one head's ids already gives ids of the right modality. The
layout of a kind asks a little more, and :class:`Grammar` says it for each position,
given the ids so far (a prompt, then what was sampled):

- DNA, text, mu-law audio: any id of the range, or ``</doc>`` (the document ends);
- codec audio: quantizer q's ids at the q-th id of each frame (ids say their quantizer);
- ``video-vq``: exactly ``(size/patch)²`` video ids per frame, then ``<eof>`` (forced);
- ``video-h264``: slice ids or ``<eof>`` (frames are ragged; a bad slice is concealed),
  ``<eof>`` forced once a frame holds 4 VBV buffers' worth of ids (``4 · buffer_frames ·
  tokens_per_frame``, far past any frame the encoder writes), so a model that never
  closes a frame still makes frames;
- a video spec that interleaves audio (``params.audio``): after every ``chunk_frames``
  frames ``<|audio|>`` is forced, the audio head then writes that chunk's samples
  (``chunk_frames / fps`` seconds at the audio spec's rate), then ``<|video|>`` is
  forced, as the tokenizer lays clips out. A prompt whose clip has no audio (more frames
  in a chunk than the spec's) turns the interleaving off.

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
        from ulysses_mm.tokenize.video.base import VideoTokenizer
        from ulysses_mm.tokenize.video.vq import VqVideoTokenizer

        self.space = space
        self.modality = tokenizer.modality
        r = space.range(self.modality)
        self.lo, self.hi = r.start, r.stop
        self.end = (DOC_END,) if end else ()
        self.frame: int | None = None  # ids per frame of a fixed-frame video kind
        self.ragged_frames = False
        self.max_frame = 0  # ids a ragged frame may reach before <eof> is forced
        self.quantizers = int(getattr(tokenizer, "n_q", 0) or 0)  # codec audio
        self.codebook = int(getattr(tokenizer, "codebook_size", 0) or 0)
        self.audio: str | None = None  # the interleaved audio modality
        if isinstance(tokenizer, VideoTokenizer):
            if isinstance(tokenizer, VqVideoTokenizer):
                self.frame = tokenizer.tokens_per_frame
            else:
                self.ragged_frames = True
                p = tokenizer.params
                buffer = float(p.get("buffer_frames", 2.0))
                self.max_frame = int(4 * buffer * tokenizer.tokens_per_frame)
            if tokenizer.audio is not None and tokenizer.audio.modality in space.modalities:
                self.audio = tokenizer.audio.modality
                a = space.range(self.audio)
                self.audio_lo, self.audio_hi = a.start, a.stop
                self.chunk = int(tokenizer.params["chunk_frames"])
                self.seconds_per_chunk = self.chunk / tokenizer.fps
                self.rate = int(tokenizer.audio.rate)
        # state
        self.in_run = ""  # the modality of the current run ("" before <|m|>)
        self.in_frame = 0  # video ids of the unfinished frame
        self.frames_in_chunk = 0
        self.chunks = 0  # chunks of frames done (each followed by its audio)
        self.in_audio = 0  # audio ids of the current chunk's audio so far
        self.ids_in_run = 0

    def _chunk_samples(self, c: int) -> int:
        """Audio samples of chunk ``c``, as the tokenizer cuts them (rounded edges)."""
        t = self.seconds_per_chunk * self.rate
        return round((c + 1) * t) - round(c * t)

    def feed(self, token: int) -> None:
        space = self.space
        if len(BASE_SPECIALS) <= token < space.num_specials:  # <|m|>: a run of m begins
            run = space.modalities[token - len(BASE_SPECIALS)]
            if run == self.modality and self.in_run == self.audio and self.audio is not None:
                self.chunks += 1  # back to video after a chunk's audio
                self.frames_in_chunk = 0
            self.in_run, self.ids_in_run = run, 0
            if run == self.audio:
                self.in_audio = 0
            return
        if token == EOF and self.in_run == self.modality:
            self.in_frame = 0
            self.frames_in_chunk += 1
            if self.audio is not None and self.frames_in_chunk > self.chunk:
                self.audio = None  # a clip without its audio track: no interleaving
            return
        if token < space.num_specials:
            return
        self.ids_in_run += 1
        if self.in_run == self.modality:
            self.in_frame += 1
        elif self.in_run == self.audio:
            self.in_audio += 1

    def next(self) -> Next:
        m = self.modality
        if not self.in_run:
            return Next(m, forced=self.space.boundary_token(m))
        if self.audio is not None:
            if self.in_run == m and self.frames_in_chunk == self.chunk and not self.in_frame:
                return Next(m, forced=self.space.boundary_token(self.audio))
            if self.in_run == self.audio:
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
            q = self.ids_in_run % self.quantizers
            lo = self.lo + q * self.codebook
            return Next(m, lo, lo + self.codebook, self.end if q == 0 else ())
        return Next(m, self.lo, self.hi, self.end)
