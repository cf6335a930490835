"""``python -m mtraining_jax.train --config ...``."""

import sys

from mtraining_jax.train.cli import main

sys.exit(main())
