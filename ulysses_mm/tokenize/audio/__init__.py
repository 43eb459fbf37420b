"""Audio: everything kinds ``audio-mulaw`` and ``audio-codec`` know.

- :mod:`~ulysses_mm.tokenize.audio.waveform`: any container FFmpeg reads -> a mono
  waveform at a given rate (decode, downmix, resample, truncation checks);
- :mod:`~ulysses_mm.tokenize.audio.base`: what both kinds share: one document per file,
  the waveform in and out, time, the WAV file, the fidelity measure, the waveform panel;
- :mod:`~ulysses_mm.tokenize.audio.mulaw`: one mu-law id per sample;
- :mod:`~ulysses_mm.tokenize.audio.codec`: a neural codec's residual-VQ codes;
- :mod:`~ulysses_mm.tokenize.audio.output`: a waveform as WAV bytes;
- :mod:`~ulysses_mm.tokenize.audio.fidelity`: SNR of the decoded waveform.
"""
