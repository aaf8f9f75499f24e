"""Long-context recall evaluation of one or more checkpoints: passkey, needle grid, RULER-style tasks,
phonebook, MQAR. Writes DIR/records.jsonl (one record per sample, resumable), a CSV pivot per task,
summary.csv / summary.md (with RULER's effective length) and PNG plots.

    python scripts/eval_recall.py checkpoints/hybrid-mini --out results/recall/hybrid-mini \
        --tasks passkey needle niah_single_1 --lengths 256 512 1024 2048 --samples 5

See `python scripts/eval_recall.py --help` and `--list-tasks`; the logic is in `hybrid.eval`.
"""

import sys

from hybrid.eval.command import main

if __name__ == "__main__":
    sys.exit(main())
