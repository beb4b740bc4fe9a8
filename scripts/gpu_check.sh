#!/usr/bin/env bash
# One device call: install the carried wheels, put the prebuilt .so in place, then run the stages named
# as arguments: tests | bench-ours | bench "H..." (ours + FLA). Logs go under $OUT, a short table last.
set -o pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .build/prebuilt/sm_90a ]; then mkdir -p kda_kcp/prebuilt && cp -r .build/prebuilt/sm_90a kda_kcp/prebuilt/; fi
if [ -f .build/triton-cache.tgz ]; then mkdir -p ~/.triton && tar xzf .build/triton-cache.tgz -C ~/.triton; fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
summary=""
while [ $# -gt 0 ]; do
  case "$1" in
    tests)
      timeout 420 python3 -m pytest -q -s tests/gpu 2>&1 | tee "$OUT/tests.log" | grep -E "rel-RMS|vs |jit:|passed|failed|Error|error|assert" | head -60
      summary="$summary\n$(tail -1 "$OUT/tests.log")";;
    variant)  # use .build/variants/NAME/kda_fwd.so from here on
      shift; mkdir -p kda_kcp/prebuilt/sm_90a && cp ".build/variants/$1/kda_fwd.so" kda_kcp/prebuilt/sm_90a/kda_fwd.so
      echo "== variant $1";;
    ncu)
      cat > /tmp/prof.py <<'PY'
import torch, sys
sys.path.insert(0, '.')
from benchmarks.bench_fwd_w1 import make_inputs
from kda_kcp.cuda import CudaBackend
from kda_kcp.plan import LocalPlan, build_plan
lens = [40000]; cu = [0, 40000]
q, k, v, g, beta = make_inputs(lens, 16, 0)
plan = LocalPlan(40000, build_plan(cu, [[(0, 40000)]]).rank_runs[0])
o = CudaBackend().fwd_output(q, k, v, g, beta, 128 ** -0.5, plan)
torch.cuda.synchronize()
PY
      timeout 300 ncu --clock-control none --kernel-name regex:chunk_kernel --launch-count 2 \
        --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis --section SourceCounters \
        python3 /tmp/prof.py > "$OUT/ncu.txt" 2>&1
      grep -E "chunk_kernel|Duration|Throughput|Stall|stall|Issue Slots|Executed Ipc|Warp Cycles|Pipe|Tensor" "$OUT/ncu.txt" | head -60;;
    bench-ours)
      python3 benchmarks/bench_fwd_w1.py --no-fla --heads ${OURS_HEADS:-4 16 64} --json "$OUT/bench_ours.json" 2>&1 | tee "$OUT/bench_ours.log" | tail -12;;
    bench)
      shift
      timeout ${BENCH_TIMEOUT:-560} python3 benchmarks/bench_fwd_w1.py --heads $1 --json "$OUT/bench_$(echo $1 | tr ' ' _).json" 2>&1 | tee "$OUT/bench_$(echo $1 | tr ' ' _).log" | tail -16
      (cd ~/.triton && tar czf "$OUT/triton-cache.tgz" cache 2>/dev/null);;
  esac
  shift
done
echo -e "$summary"
