#!/usr/bin/env bash
# The README's recall tables and plots for the default checkpoint. Resumable: rerunning skips finished
# samples. Times measured on 2 idle cores: step 1 about 8 minutes, step 2 about 6 (with the copies).
# Override CKPT / OUT / THREADS / QUANT_DIR in the environment.
set -euo pipefail
CKPT=${CKPT:-checkpoints/hybrid-mini}
OUT=${OUT:-docs/recall}
THREADS=${THREADS:-2}
QUANT_DIR=${QUANT_DIR:-$(mktemp -d)}

# 1. The needle grid: passkey, needle (the trained format), RULER niah_single_1, from half to 64x the
#    256-token training length, 5 depths, 3 samples per cell -> heatmap_*.png, accuracy_vs_length.png.
python scripts/eval_recall.py "$CKPT" --out "$OUT/hybrid-mini" \
  --tasks passkey needle niah_single_1 --lengths 128 256 512 1024 2048 4096 8192 16384 \
  --depths 0 25 50 75 100 --samples 3 --threads "$THREADS"

# 2. bf16 vs its FP8 and NVFP4 copies (weight-only compute), in one table and one plot.
for format in fp8 nvfp4; do
  [ -d "$QUANT_DIR/$format" ] || hybrid quantize "$CKPT" "$QUANT_DIR/$format" --format "$format"
done
python scripts/eval_recall.py "$CKPT" "$QUANT_DIR/fp8" "$QUANT_DIR/nvfp4" --labels bf16 fp8 nvfp4 \
  --out "$OUT/quantized" --tasks passkey needle niah_single_1 --lengths 256 512 1024 2048 4096 8192 \
  --depths 0 50 100 --samples 3 --threads "$THREADS"
