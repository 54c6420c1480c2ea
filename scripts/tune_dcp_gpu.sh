#!/usr/bin/env bash
# Tune symm_a2a's launch shape on the GPU machine, then verify the best shape:
#
#   [SWEEP_CONFIGS="rows,per_sm,warps[,max_programs[,stagger_bytes[,split[,pdl[,wide]]]]] ..."]
#   [SWEEP_TOKENS="64 128"] [SWEEP_ROUNDS=1] [AB_KERNELS="path/to/symm_a2a.py ..."]
#   [AB_CONFIG=rows,per_sm,...] \
#     bash scripts/tune_dcp_gpu.sh [gpu_check steps...]   (default steps after the sweep: tests dcp)
#
# 1. times symm_a2a (graph mode, 64 heads × 512, bf16, W=2) at SWEEP_TOKENS for each (max block
#    rows, programs per SM, max warps, grid cap (0 = none), staggered sends from this many bytes
#    per peer (0 = never), percent of the grid in the first group, programmatic dependent launch
#    (1/0), warps for blocks of ≥ 32 KiB (not capped by max warps; 0 = no exception)) below,
#    through the private knobs ATTNCOMM_SYMM_MAX_BLOCK_ROWS / _PROGRAMS_PER_SM / _MAX_WARPS /
#    _MAX_PROGRAMS / _STAGGER_MIN_BYTES / _STAGGER_SPLIT / _PDL / _WIDE_WARPS (SymmConfig.from_env,
#    the same on every rank), writing
#    $OUT/sweep.log. Every file of AB_KERNELS (paths relative to the repository root) is timed
#    too, in place of attncomm/dcp/lse_merge/symm_a2a.py, with AB_CONFIG (default 64-row blocks, staggering
#    and PDL off: older kernels lack them): an A/B of kernel versions in one call, not a
#    candidate for best.
#    With SWEEP_ROUNDS=R everything runs R times, in turn, and the mean counts.
# 2. exports the shape with the lowest mean 128-token latency and runs scripts/gpu_check.sh with
#    it, so the GPU tests and the committed benchmark run with exactly that shape.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 ATTNCOMM_TIMEOUT_S=10
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/attncomm-triton}
SWEEP=$(mktemp -d)
CONFIGS=${SWEEP_CONFIGS:-"64,1,16,0,1048576,50,0 64,1,16,0,1048576,50,1"}
TOKENS=${SWEEP_TOKENS:-"64 128"}
AB_CONFIG=${AB_CONFIG:-64,1,16,0,0,50,0}
K=attncomm/dcp/lse_merge/symm_a2a.py
cp "$K" "$SWEEP/current_kernel.py"
trap 'cp "$SWEEP/current_kernel.py" "$K"' EXIT  # the kernel file comes back whatever happens
sweep_one() {  # sweep_one CONFIG JSON
  local rows per_sm warps cap stagger split pdl wide
  IFS=, read -r rows per_sm warps cap stagger split pdl wide <<<"$1"
  ATTNCOMM_SYMM_MAX_BLOCK_ROWS=$rows ATTNCOMM_SYMM_PROGRAMS_PER_SM=$per_sm \
  ATTNCOMM_SYMM_MAX_WARPS=$warps ATTNCOMM_SYMM_MAX_PROGRAMS=${cap:-0} \
  ATTNCOMM_SYMM_STAGGER_MIN_BYTES=${stagger:-1048576} ATTNCOMM_SYMM_STAGGER_SPLIT=${split:-50} \
  ATTNCOMM_SYMM_PDL=${pdl:-1} ATTNCOMM_SYMM_WIDE_WARPS=${wide:-32} timeout -k 5 60 python3 -m attncomm.cli bench dcp \
    --device cuda --world-size 2 --backends symm_a2a --modes graph --tokens $TOKENS \
    --no-progress --json "$2" >"${2%.json}.log" 2>&1
}
for round in $(seq "${SWEEP_ROUNDS:-1}"); do
  for cfg in $CONFIGS; do
    sweep_one "$cfg" "$SWEEP/cfg=$cfg=$round.json"
    echo "round $round $cfg rc=$?" | tee -a "$OUT/sweep.log"
  done
  for ab in ${AB_KERNELS:-}; do
    if cp "$ab" "$K"; then
      sweep_one "$AB_CONFIG" "$SWEEP/ab=${ab//\//:}=$round.json"
      echo "round $round A/B $ab ($AB_CONFIG) rc=$?" | tee -a "$OUT/sweep.log"
    else
      echo "A/B skipped: cannot read $ab" | tee -a "$OUT/sweep.log"
    fi
    cp "$SWEEP/current_kernel.py" "$K"
  done
done
BEST=$(python3 - "$SWEEP" <<'EOF' | tee -a "$OUT/sweep.log" | tail -1
import collections, json, pathlib, statistics, sys
lat = collections.defaultdict(lambda: collections.defaultdict(list))
for f in sorted(pathlib.Path(sys.argv[1]).glob("*=*=*.json")):
    kind, rest = f.stem.split("=", 1)
    name = rest.rsplit("=", 1)[0]
    for r in json.load(open(f))["records"]:
        if r["backend"] == "symm_a2a" and r["mode"] == "graph":
            lat[(kind, name.replace(":", "/"))][r["tokens"]].append(r["latency_us"])
rows = []
for (kind, name), by_t in lat.items():
    mean = {t: statistics.mean(v) for t, v in by_t.items()}
    runs = {t: " ".join(f"{x:.2f}" for x in v) for t, v in by_t.items()}
    label = "kernel " + name if kind == "ab" else "rows,per_sm,warps,cap,stagger,split,pdl,wide=" + name
    print(label + ": " + ", ".join(f"{t} tokens {mean[t]:.2f} us ({runs[t]})"
                                    for t in sorted(mean)))
    if kind == "cfg" and 128 in mean:
        rows.append((mean[128], name))
print(min(rows)[1] if rows else "none: no configuration timed at 128 tokens")
EOF
)
if ! [[ $BEST =~ ^[0-9]+(,[0-9]+){2,7}$ ]]; then
  echo "no best shape from the sweep ($BEST): the defaults" | tee -a "$OUT/sweep.log"
  BEST=64,1,16,0,1048576,50,1,32
fi
IFS=, read -r rows per_sm warps cap stagger split pdl wide <<<"$BEST"
echo "best: rows=$rows programs_per_sm=$per_sm warps=$warps max_programs=${cap:-0}" \
  "stagger_min_bytes=${stagger:-1048576} split=${split:-50} pdl=${pdl:-1} wide=${wide:-32}" | tee -a "$OUT/sweep.log"
export ATTNCOMM_SYMM_MAX_BLOCK_ROWS=$rows ATTNCOMM_SYMM_PROGRAMS_PER_SM=$per_sm \
  ATTNCOMM_SYMM_MAX_WARPS=$warps ATTNCOMM_SYMM_MAX_PROGRAMS=${cap:-0} \
  ATTNCOMM_SYMM_STAGGER_MIN_BYTES=${stagger:-1048576} ATTNCOMM_SYMM_STAGGER_SPLIT=${split:-50} \
  ATTNCOMM_SYMM_PDL=${pdl:-1} ATTNCOMM_SYMM_WIDE_WARPS=${wide:-32}
bash scripts/gpu_check.sh ${*:-tests dcp}
