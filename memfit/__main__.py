"""`python -m memfit ...`: the memfit command."""

import sys

from memfit.cli import program

sys.exit(program())
