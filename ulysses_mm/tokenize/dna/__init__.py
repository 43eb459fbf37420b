"""DNA: everything kind ``dna-base`` knows.

- :mod:`~ulysses_mm.tokenize.dna.tokenizer`: FASTA/FASTQ/GenBank records -> one id per
  base (and the contract: token names, unit, media, fidelity, picture);
- :mod:`~ulysses_mm.tokenize.dna.stream`: the same ids read from a byte stream in blocks;
- :mod:`~ulysses_mm.tokenize.dna.output`: ids -> a FASTA file, the GC track of ``inspect``;
- :mod:`~ulysses_mm.tokenize.dna.fidelity`: whether bases come back exactly.
"""
