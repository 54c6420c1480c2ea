#!/usr/bin/env bash
# Tune symm_a2a's flag-protocol launch shape on the GPU machine, then verify the best shape:
#
#   [SWEEP_CONFIGS="rows,per_sm,warps[,max_programs] ..."] [AB_KERNEL=path/to/symm_a2a.py] \
#     bash scripts/tune_dcp_gpu.sh [gpu_check steps...]   (default steps after the sweep: tests dcp)
#
# 1. times symm_a2a (graph mode, 64 heads × 512, bf16, W=2) at 64 and 128 tokens for each
#    (max block rows, programs per SM, max warps, grid cap; 0 = none) below, through the private
#    knobs ATTNCOMM_SYMM_MAX_BLOCK_ROWS / _PROGRAMS_PER_SM / _MAX_WARPS / _MAX_PROGRAMS (read at
#    import, the same on every rank), writing $OUT/sweep.log; with AB_KERNEL, also the default
#    shape with that file in place of attncomm/dcp/symm_a2a.py (an A/B of two kernel versions in
#    one call; it takes no part in choosing the best);
# 2. exports the shape with the lowest 128-token latency and runs scripts/gpu_check.sh with it,
#    so the GPU tests and the committed benchmark run with exactly that shape.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 ATTNCOMM_TIMEOUT_S=10
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/attncomm-triton}
SWEEP=$(mktemp -d)
CONFIGS=${SWEEP_CONFIGS:-"64,1,16,0 32,1,16,0 32,1,16,64 16,1,16,64 16,1,8,0 64,1,16,32"}
sweep_one() {  # sweep_one CONFIG JSON
  local rows per_sm warps cap
  IFS=, read -r rows per_sm warps cap <<<"$1"
  ATTNCOMM_SYMM_MAX_BLOCK_ROWS=$rows ATTNCOMM_SYMM_PROGRAMS_PER_SM=$per_sm \
  ATTNCOMM_SYMM_MAX_WARPS=$warps ATTNCOMM_SYMM_MAX_PROGRAMS=${cap:-0} \
    timeout -k 5 40 python3 -m attncomm.cli bench dcp \
    --device cuda --world-size 2 --backends symm_a2a --modes graph --tokens 64 128 \
    --no-progress --json "$2" >"${2%.json}.log" 2>&1
}
for cfg in $CONFIGS; do
  sweep_one "$cfg" "$SWEEP/$cfg.json"
  echo "$cfg rc=$?" | tee -a "$OUT/sweep.log"
done
if [ -n "${AB_KERNEL:-}" ]; then  # a path relative to the repository root
  K=attncomm/dcp/symm_a2a.py
  cp "$K" "$SWEEP/current_kernel.py"
  trap 'cp "$SWEEP/current_kernel.py" "$K"' EXIT  # the kernel file comes back whatever happens
  AB=$(mktemp -d)
  if cp "$AB_KERNEL" "$K"; then
    sweep_one 64,1,16,0 "$AB/ab.json"
    echo "A/B $AB_KERNEL (64,1,16,0) rc=$?" | tee -a "$OUT/sweep.log"
  else
    echo "A/B skipped: cannot read $AB_KERNEL" | tee -a "$OUT/sweep.log"
  fi
  cp "$SWEEP/current_kernel.py" "$K"
  [ -f "$AB/ab.json" ] && python3 -c 'import json, sys
for r in json.load(open(sys.argv[1]))["records"]:
    print("A/B kernel %s: %d tokens %.2f us" % (sys.argv[2], r["tokens"], r["latency_us"]))' \
    "$AB/ab.json" "$AB_KERNEL" | tee -a "$OUT/sweep.log"
fi
BEST=$(python3 - "$SWEEP" <<'EOF' | tee -a "$OUT/sweep.log" | tail -1
import json, pathlib, sys
rows = []
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    lat = {r["tokens"]: r["latency_us"] for r in json.load(open(f))["records"]
           if r["backend"] == "symm_a2a" and r["mode"] == "graph"}
    if 64 in lat and 128 in lat:
        rows.append((lat[128], lat[64], f.stem))
for t128, t64, cfg in sorted(rows):
    print(f"rows,per_sm,warps,cap={cfg}: 64 tokens {t64:.2f} us, 128 tokens {t128:.2f} us")
print(sorted(rows)[0][2] if rows else "64,1,16,0")
EOF
)
IFS=, read -r rows per_sm warps cap <<<"$BEST"
echo "best: rows=$rows programs_per_sm=$per_sm warps=$warps max_programs=${cap:-0}" \
  | tee -a "$OUT/sweep.log"
export ATTNCOMM_SYMM_MAX_BLOCK_ROWS=$rows ATTNCOMM_SYMM_PROGRAMS_PER_SM=$per_sm \
  ATTNCOMM_SYMM_MAX_WARPS=$warps ATTNCOMM_SYMM_MAX_PROGRAMS=${cap:-0}
bash scripts/gpu_check.sh ${*:-tests dcp}
