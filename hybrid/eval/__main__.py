"""`python -m hybrid.eval ...`: the recall evaluation command line (see `hybrid.eval.command`)."""

import sys

from hybrid.eval.command import main

sys.exit(main())
