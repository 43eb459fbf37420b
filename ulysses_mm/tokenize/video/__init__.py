"""Video: everything kinds ``video-vq`` and ``video-h264`` know, and what any video kind reuses.

- :mod:`~ulysses_mm.tokenize.video.frames`: frames sampled at a rate, resized and cropped;
- :mod:`~ulysses_mm.tokenize.video.base`: what every video kind shares (one clip document,
  frames closed by ``<eof>``, audio interleaving, the unit, layout, MP4, seconds, PSNR,
  frame strip of the Tokenizer contract);
- :mod:`~ulysses_mm.tokenize.video.vq`: per-patch codebook ids, fixed frames;
- :mod:`~ulysses_mm.tokenize.video.h264`: H.264 slice bytes as ids, ragged frames;
- :mod:`~ulysses_mm.tokenize.video.kmeans`, :mod:`~ulysses_mm.tokenize.video.fit`: the
  codebook and ``ulysses-mm tokenizer fit video``;
- :mod:`~ulysses_mm.tokenize.video.output`: frames as an MP4;
- :mod:`~ulysses_mm.tokenize.video.fidelity`: PSNR of the decoded frames.

A new kind lives in a subpackage (``video/<kind>/``), subclasses
:class:`~ulysses_mm.tokenize.video.base.VideoTokenizer` and takes one line in
:mod:`ulysses_mm.tokenize.registry`.
"""
