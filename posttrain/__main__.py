"""`python -m posttrain ...` (also what `torchrun -m posttrain` runs)."""

from posttrain.cli import program

program()
