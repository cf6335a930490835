"""``python -m mtraining_jax.eval`` = ``mtraining-eval``."""

import sys

from mtraining_jax.eval.cli import main

sys.exit(main())
