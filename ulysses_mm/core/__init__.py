"""What every stage shares: the token space, the packed-sample format, the layout rules,
the errors and storage. Torch-free."""
