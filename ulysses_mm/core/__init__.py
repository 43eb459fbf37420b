"""What every stage shares: the token space, the packed-sample format, the layout rules,
the errors, storage and the files the package ships (:mod:`ulysses_mm.core.resources`).
Torch-free."""
