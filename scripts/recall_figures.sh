#!/usr/bin/env bash
# The README's recall tables and plots for the default checkpoint. Resumable: rerunning skips finished
# samples. Rough times on 2 busy CPU cores: step 1 20-40 min, step 2 15-30 min, step 3 about 3x the
# passkey/needle part of step 1 at its lengths. Override CKPT / OUT / THREADS in the environment.
set -euo pipefail
CKPT=${CKPT:-checkpoints/hybrid-mini}
OUT=${OUT:-docs/recall}
THREADS=${THREADS:-2}

# 1. The needle grid: passkey, needle (the trained format), RULER niah_single_1, from half to 16x the
#    512-token training length, 11 depths, 5 samples per cell -> heatmap_*.png, accuracy_vs_length.png.
python scripts/eval_recall.py "$CKPT" --out "$OUT/hybrid-mini" \
  --tasks passkey needle niah_single_1 --lengths 256 512 1024 2048 4096 8192 \
  --depths 0 10 20 30 40 50 60 70 80 90 100 --samples 5 --threads "$THREADS"

# 2. The RULER-style suite (noise and distractor haystacks, vt, cwe, fwe) with phonebook, kv_recall and
#    MQAR, needle depth 50% where the task has one, 10 samples per cell -> summary.md.
python scripts/eval_recall.py "$CKPT" --out "$OUT/hybrid-mini-ruler" \
  --tasks ruler phonebook kv_recall mqar --lengths 512 1024 2048 4096 --depths 50 --samples 10 \
  --threads "$THREADS"

# 3. bf16 vs its FP8 and NVFP4 copies (weight-only compute), in one table and one plot. Needs
#    `hybrid quantize` (the quantization issue); the copies are made once.
for format in fp8 nvfp4; do
  [ -d "$CKPT-$format" ] || hybrid quantize "$CKPT" "$CKPT-$format" --format "$format"
done
python scripts/eval_recall.py "$CKPT" "$CKPT-fp8" "$CKPT-nvfp4" --labels bf16 fp8 nvfp4 \
  --out "$OUT/quantized" --tasks passkey needle niah_single_1 mqar --lengths 512 1024 2048 4096 \
  --depths 0 25 50 75 100 --samples 5 --threads "$THREADS"
