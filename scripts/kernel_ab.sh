#!/usr/bin/env bash
# One device call: the kernels of this tree against BASE's (a git revision, or a tree already
# extracted there, e.g. a `git archive` carried to the device machine, which has no git) with
# W simulated ranks on one GPU — the merge, the query gather, the fill, each tree's script in
# processes of its own, outputs compared bit for bit (scripts/ab_tree.py) — then the GPU tests of
# those kernels. Run from anywhere on the one-GPU machine through the device tool:
#
#   bash scripts/kernel_ab.sh BASE [steps...]     steps: merge gather fill tests (default all)
#
# Each step has its own time limit (a hang cannot eat the call) and a failing step does not stop
# the others. Writes $OUT/kernel-ab.log and $OUT/results.tgz (the runs' JSON and summaries, the
# junit XML), the archive rewritten after every step.
set -uo pipefail
cd "$(dirname "$0")/.."
BASE=${1:?usage: kernel_ab.sh BASE [steps...]}
shift
OUT=${OUT:-$PWD/out}
RES=$(mktemp -d)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# NVLink multicast stays off (HARDWARE.md), also in every process started from here.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/attncomm-triton}
mkdir -p "$OUT"
LOG=$OUT/kernel-ab.log
STEPS=${*:-merge gather fill tests}
LIMIT_MERGE=${LIMIT_MERGE:-100} LIMIT_GATHER=${LIMIT_GATHER:-100}
LIMIT_FILL=${LIMIT_FILL:-80} LIMIT_TESTS=${LIMIT_TESTS:-150}
status=0

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "===== [$name] $(date -u +%T) (limit ${limit}s): $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "===== [$name] rc=$rc in $((SECONDS - t0))s" | tee -a "$LOG"
  [ $rc -eq 0 ] || status=1
  rm -f "$RES"/*.pt  # the dumps stay on the machine (compared there)
  cp "$LOG" "$RES/"
  tar czf "$OUT/results.tgz" -C "$RES" .
}

want() { [[ " $STEPS " == *" $1 "* ]]; }

step versions 30 python3 -c 'import sys, torch, triton; print(sys.version); \
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__); \
print(torch.cuda.get_device_name(0))'
if want merge; then
  step merge "$LIMIT_MERGE" python3 scripts/dcp_one_gpu.py --ab "$BASE" --rounds 2 --pdl \
    --out "$RES"
fi
if want gather; then
  step gather "$LIMIT_GATHER" python3 scripts/dcp_gather_one_gpu.py --ab "$BASE" --rounds 2 \
    --tokens 1 4 16 128 --replays 20 --out "$RES"
fi
if want fill; then
  step fill "$LIMIT_FILL" python3 scripts/fill_one_gpu.py --ab "$BASE" --rounds 2 --seq 8192 \
    --out "$RES"
fi
if want tests; then
  step gpu-tests "$LIMIT_TESTS" python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/gpu/test_dcp_gpu.py tests/gpu/test_dcp_gather_gpu.py \
    tests/gpu/test_ulysses_fill_gpu.py tests/gpu/test_substrate_gpu.py \
    --junitxml="$RES/gpu-tests.xml"
fi
echo "results: $(ls "$RES" | tr '\n' ' ')" | tee -a "$LOG"
exit $status
