"""What every stage shares: the token space, the packed-sample format, the layout rules,
the errors and storage. Torch-free."""

from pathlib import Path

# The source checkout this package runs from (its pipelines/, configs/, tokenizers/ and
# tests/data/ sit beside the package in a clone; an installed wheel has none of them).
REPO = Path(__file__).resolve().parents[2]
