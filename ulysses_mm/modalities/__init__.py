"""Modality decoders and tokenizers (DNA, audio, video)."""
