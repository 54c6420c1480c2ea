#!/usr/bin/env bash
# Tune symm_a2a's flag-protocol launch shape on the GPU machine, then verify the best shape:
#
#   bash scripts/tune_dcp_gpu.sh [gpu_check steps...]   (default steps after the sweep: tests dcp)
#
# 1. times symm_a2a (graph mode, 64 heads × 512, bf16, W=2) at 64 and 128 tokens for each
#    (max block rows, programs per SM, max warps) below, through the private knobs
#    ATTNCOMM_SYMM_MAX_BLOCK_ROWS / _PROGRAMS_PER_SM / _MAX_WARPS (read at import, the same on
#    every rank), writing $OUT/sweep.log;
# 2. exports the shape with the lowest 128-token latency and runs scripts/gpu_check.sh with it,
#    so the GPU tests and the committed benchmark run with exactly that shape.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 ATTNCOMM_TIMEOUT_S=10
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/attncomm-triton}
SWEEP=$(mktemp -d)
CONFIGS="32,1,8 32,1,16 16,1,8 16,2,8 16,2,16 64,1,16"
for cfg in $CONFIGS; do
  IFS=, read -r rows per_sm warps <<<"$cfg"
  ATTNCOMM_SYMM_MAX_BLOCK_ROWS=$rows ATTNCOMM_SYMM_PROGRAMS_PER_SM=$per_sm \
  ATTNCOMM_SYMM_MAX_WARPS=$warps timeout -k 5 30 python3 -m attncomm.cli bench dcp \
    --device cuda --world-size 2 --backends symm_a2a --modes graph --tokens 64 128 \
    --no-progress --json "$SWEEP/$cfg.json" >"$SWEEP/$cfg.log" 2>&1
  echo "$cfg rc=$?" | tee -a "$OUT/sweep.log"
done
BEST=$(python3 - "$SWEEP" <<'EOF' | tee -a "$OUT/sweep.log" | tail -1
import json, pathlib, sys
rows = []
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    lat = {r["tokens"]: r["latency_us"] for r in json.load(open(f))["records"]
           if r["backend"] == "symm_a2a" and r["mode"] == "graph"}
    if 64 in lat and 128 in lat:
        rows.append((lat[128], lat[64], f.stem))
for t128, t64, cfg in sorted(rows):
    print(f"rows,per_sm,warps={cfg}: 64 tokens {t64:.2f} us, 128 tokens {t128:.2f} us")
print(sorted(rows)[0][2] if rows else "32,1,8")
EOF
)
IFS=, read -r rows per_sm warps <<<"$BEST"
echo "best: rows=$rows programs_per_sm=$per_sm warps=$warps" | tee -a "$OUT/sweep.log"
export ATTNCOMM_SYMM_MAX_BLOCK_ROWS=$rows ATTNCOMM_SYMM_PROGRAMS_PER_SM=$per_sm \
  ATTNCOMM_SYMM_MAX_WARPS=$warps
bash scripts/gpu_check.sh ${*:-tests dcp}
