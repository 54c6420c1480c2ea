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
  --markdown "$OUT/ulysses.md" 2>&1 | tee "$OUT/bench.log"
if [ -d .models/minilm-fp16 ]; then
  for dt in fp32 bf16; do
    timeout ${ULYSSES_DEMO_S:-100} python3 -m attncomm.cli demo --device cuda --world-size 2 \
      --mode ulysses --dtype $dt --model-dir .models/minilm-fp16 2>&1 | tail -8 | tee -a "$OUT/demo.log"
  done
fi
# UlyssesAttention on the DiT geometry (B=1, S=32768, 24 heads, D=128, bf16, SDPA): sequential
# vs pipelined head groups, per transport; eager, slowest-rank median of 10.
cat > /tmp/ulysses_pipe.py <<'PY'
import torch, attncomm
from attncomm.bench import common
from attncomm.launch import cpu_group
from attncomm.ulysses import UlyssesAttention
def f(rank, world):
    dev = torch.device("cuda", rank)
    q, k, v = (torch.randn(1, 32768 // world, 24, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
    out, ref = [], None
    for backend in ("all_to_all", "ce"):
        for pg in (0, -1, 2, 4):
            m = UlyssesAttention(backend=backend, pipeline_groups=pg, validate=False)
            y = m(q, k, v)
            ref = y if ref is None else ref
            t = common.slowest_rank_median(common.time_eager(lambda: m(q, k, v), warmup=3, iters=10), cpu_group(None))
            out.append((backend, pg, m.last_pipeline_groups, round(t, 1), bool(torch.equal(y, ref))))
    return out
if __name__ == "__main__":
    for row in attncomm.launch(f, 2, device="cuda")[0]:
        print("attn", row)
PY
timeout ${ULYSSES_PIPE_S:-90} python3 /tmp/ulysses_pipe.py 2>&1 | tail -12 | tee "$OUT/pipeline.log"
