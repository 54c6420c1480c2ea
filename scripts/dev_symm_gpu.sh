#!/usr/bin/env bash
# Developer run of the symm_a2a work on the 2-GPU device: correctness, then the bench, then a
# small tuning sweep. Logs and results go to $OUT. Usage: scripts/dev_symm_gpu.sh [stage...]
set -u
cd "$(dirname "$0")/.."
export ATTNCOMM_TIMEOUT_S=${ATTNCOMM_TIMEOUT_S:-20} PYTHONPATH=$PWD TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1 ATTNCOMM_MACHINE=nvidia-h200-x2
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
stages=${*:-"facts tests bench sweep"}
for s in $stages; do
  case $s in
  facts)
    nvidia-smi -L; python3 -c 'import torch,triton;print(torch.__version__,triton.__version__,torch.cuda.device_count())'
    ;;
  env)
    python3 -m attncomm.cli env --json "$OUT/env.json" 2>&1 | tee "$OUT/env.log"
    ;;
  tests)
    ATTNCOMM_TIMEOUT_S=20 timeout -k 5 ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider \
      tests/gpu/test_dcp_gpu.py ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tee "$OUT/pytest.log" | tail -40
    ;;
  bench)
    timeout -k 5 ${BENCH_S:-120} python3 -m attncomm.cli bench dcp --no-progress \
      --json "$OUT/dcp.json" --plot "$OUT/dcp.png" 2>&1 | tee "$OUT/bench.log"
    ;;
  sweep)
    small="--tokens 1 8 16 32"; large="--tokens 32 64 128"
    while read -r kv toks; do
      echo "== $kv $toks"
      env ${kv//_ATTNCOMM/ ATTNCOMM} timeout -k 5 40 python3 -m attncomm.cli bench dcp --no-progress --backends symm_a2a \
        --modes graph $toks </dev/null 2>&1 | grep -E "symm_a2a|Error|error" | tail -6
    done 2>&1 <<LIST | tee "$OUT/sweep.log"
ATTNCOMM_SYMM_LL_MAX_BYTES=262144 $small
ATTNCOMM_SYMM_MAX_BLOCK_ROWS=4 $large
ATTNCOMM_SYMM_MAX_BLOCK_ROWS=8 $large
ATTNCOMM_SYMM_MAX_BLOCK_ROWS=32 $large
LIST
    ;;
  esac
done
