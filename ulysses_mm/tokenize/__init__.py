"""Raw media → token documents, and back: one package per modality (``dna/``, ``audio/``,
``video/``, ``text/``) behind the :class:`~ulysses_mm.tokenize.base.Tokenizer` contract,
built from specs by :mod:`~ulysses_mm.tokenize.registry` (the one list of kinds); the
cross-cutting pieces (framing, params, grammar, media writing, fidelity driver) at this
level never ask which kind they hold."""
