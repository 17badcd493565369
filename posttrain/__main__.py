"""`python -m posttrain ...` (also what `torchrun -m posttrain` runs)."""

import sys

from posttrain.cli import main

sys.exit(main())
