"""`python -m dsjax`: the `dsjax` command line, for environments where the console script is not on PATH."""

import sys

from dsjax.cli import main

sys.exit(main())
