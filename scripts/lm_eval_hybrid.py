"""The `lm_eval` command with this project's `hybrid` model registered (lm-eval has no plugin mechanism
for models, so the plain `lm_eval` executable cannot see it). Same arguments as `lm_eval`:

    python scripts/lm_eval_hybrid.py --model hybrid --model_args pretrained=checkpoints/hybrid-mini \
        --tasks niah_single_1 --metadata '{"max_seq_lengths":[1024]}' --limit 20

Installed as the `hybrid-lm-eval` command too. Needs the `eval` extra: pip install -e ".[eval]".
"""

from hybrid.eval.command import lm_eval_main

if __name__ == "__main__":
    lm_eval_main()
