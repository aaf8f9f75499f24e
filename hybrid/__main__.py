"""`python -m hybrid ...`: the `hybrid` command (what `torchrun --nproc-per-node N -m hybrid generate ...` runs)."""

import sys

from hybrid.cli import main

sys.exit(main())
