#!/bin/bash
# Ulysses GPU checks for one device call: probes, GPU tests, the benchmark. Logs go to $OUT.
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ulysses_out}
mkdir -p "$OUT"
MAXB=${ULYSSES_MAX_BYTES:-1073741824}
{ nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)";
  python3 -c "import cuda.bindings as c; print('cuda.bindings', c.__version__)"; } > "$OUT/env.txt" 2>&1
timeout ${ULYSSES_TEST_S:-170} python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_ulysses_gpu.py \
  2>&1 | tee "$OUT/gpu_tests.log"
timeout ${ULYSSES_BENCH_S:-150} python3 -m attncomm.cli bench ulysses --world-size 2 --device cuda \
  --no-progress --max-bytes "$MAXB" --json "$OUT/ulysses.json" --plot "$OUT/ulysses.png" \
  2>&1 | tee "$OUT/bench.log"
