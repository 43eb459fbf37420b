"""Text: everything kind ``text`` knows.

- :mod:`~ulysses_mm.tokenize.text.tokenizer`: a local transformers tokenizer over .txt and
  .jsonl inputs, and its part of the Tokenizer contract: its own tokens as names, bits per
  UTF-8 byte (:func:`~ulysses_mm.tokenize.text.tokenizer.token_bytes`); generated ids are
  written and drawn as text by the contract's defaults.
"""
