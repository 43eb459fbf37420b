"""Kind ``video-codec``: video through a learned (neural) tokenizer read from a local
directory — transformers' ``Emu3VQVAE`` or Cosmos DV's TorchScript files."""
