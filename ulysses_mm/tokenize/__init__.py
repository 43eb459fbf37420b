"""Raw media → token documents: decoders and tokenizers per modality, fitted from specs."""
