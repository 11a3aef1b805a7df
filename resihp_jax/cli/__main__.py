"""`python -m resihp_jax.cli ARGS` == `resihp ARGS` (what the local launcher starts)."""

import sys

from resihp_jax.cli.commands import main

sys.exit(main())
