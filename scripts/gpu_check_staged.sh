#!/usr/bin/env bash
# One device call for the staged forward (v4): install the carried wheels, put the prebuilt .so files in
# place (.build/v4/prebuilt/<arch>, built without a GPU as NOTES.md (staged forward v4) says; NO_PREBUILT=1 JIT-builds
# here instead), then run the stages named as arguments (default: smoke tests bench sanitize):
#   smoke      one small v4 call against the FP64 oracle (stops the script when it fails)
#   tests      tests/gpu/test_fwd_staged.py and the CPU emulation
#   bench      benchmarks/bench_fwd_staged.py: v3, v4 and FLA at H = $HEADS (default "4 16 64"),
#              v4 walk widths $WARPS (default "4 2 8"), v4 segment lengths $SEGS (default "0 100000": the
#              model's choice and unsegmented), v4 stage times; JSON and log under $OUT
#   sanitize   compute-sanitizer memcheck, racecheck, initcheck on the smoke's v4 calls (as time allows)
# Logs go under $OUT; a short table comes last.
# Device command (from the repository root, carry [".whl", ".build/v4/prebuilt", ".build/triton-cache.tgz"]):
#   bash scripts/gpu_check_staged.sh
set -o pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
arch=$(python3 -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'sm_{m}{n}a')")
if [ -d ".build/v4/prebuilt/$arch" ] && [ "${NO_PREBUILT:-0}" != 1 ]; then
  mkdir -p "kda_kcp/prebuilt/$arch" && cp .build/v4/prebuilt/"$arch"/*.so "kda_kcp/prebuilt/$arch/"
  # a .so built on the workstation's image may not load here: then JIT-build on this machine instead
  if ! python3 -c "from kda_kcp.cuda.staged import _modules; import torch; _modules(torch.device('cuda'))" \
      > "$OUT/load.log" 2>&1; then
    echo "prebuilt .so did not load ($(tail -1 "$OUT/load.log")): JIT build"; rm -rf "kda_kcp/prebuilt/$arch"
  fi
  echo "prebuilt: $(ls kda_kcp/prebuilt/$arch 2>/dev/null)"
fi
if [ -f .build/triton-cache.tgz ]; then mkdir -p ~/.triton && tar xzf .build/triton-cache.tgz -C ~/.triton; fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"
left() { echo $(( ${BUDGET:-570} - ($(date +%s) - T0) )); }
stages=("$@"); [ ${#stages[@]} -eq 0 ] && stages=(smoke tests bench sanitize)
summary=""
cat > /tmp/v4_smoke.py <<'PY'
import sys, torch
sys.path.insert(0, '.')
from tests.gpu.gpu_common import make_inputs, local_plan, rel
from kda_kcp.cuda.staged import fwd_output
from kda_kcp.reference import naive_kda
gen = torch.Generator().manual_seed(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
import os
sanitize = os.environ.get("SMOKE_SANITIZE") == "1"  # small batch, no FP64 oracle (thousands of launches)
cu = [0, 1, 65, 65, 300] if sanitize else [0, 1, 65, 65, 700, 2300]
inputs = make_inputs(cu[-1], 2, gen)
ref = None if sanitize else naive_kda(*inputs, cu, scale=128 ** -0.5)
ok = True
for warps, seg in (("4", ""), ("4", "2"), ("2", "3"), ("8", "1")):  # default, then segmented (summaries + fold)
    os.environ["KDA_KCP_V4_WARPS"], os.environ["KDA_KCP_SEG_CHUNKS"] = warps, seg
    o = fwd_output(*inputs, 128 ** -0.5, local_plan(cu))
    torch.cuda.synchronize()
    err = rel(o, ref) if ref is not None else float("nan")
    fin = bool(torch.isfinite(o.float()).all())
    ok = ok and fin and (ref is None or err <= 4e-3)
    print(f"smoke: warps={warps} seg_chunks={seg or 'model'} finite={fin} o rel-RMS vs FP64 = {err:.3e}")
sys.exit(0 if ok else 1)
PY
for st in "${stages[@]}"; do
  echo "== $st ($(left) s left)"
  case "$st" in
    smoke)
      timeout 240 python3 /tmp/v4_smoke.py 2>&1 | tee "$OUT/smoke.log" | tail -20
      rc=$?; summary="$summary\n$(grep smoke: "$OUT/smoke.log" | tr '\n' ';') rc=$rc"
      if [ $rc -ne 0 ]; then echo "smoke failed: stopping"; stages=(); break; fi;;
    tests)
      timeout $(( $(left) < 240 ? $(left) : 240 )) python3 -m pytest -q -s tests/gpu/test_fwd_staged.py \
        tests/gpu/test_staged_emulation.py 2>&1 | tee "$OUT/tests.log" \
        | grep -E "rel-RMS|vs |summaries|passed|failed|Error|error|assert" | head -60
      summary="$summary\ntests: $(tail -1 "$OUT/tests.log")";;
    bench)
      timeout $(( $(left) - 60 )) python3 benchmarks/bench_fwd_staged.py --heads ${HEADS:-4 16 64} \
        --warps ${WARPS:-4 2 8} --segs ${SEGS:-0 100000} --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | tail -30
      (cd ~/.triton 2>/dev/null && tar czf "$OUT/triton-cache.tgz" cache 2>/dev/null);;
    sanitize)
      if [ "$(left)" -lt 60 ]; then echo "no time left for sanitize"; continue; fi
      for tool in memcheck racecheck initcheck; do
        if [ "$(left)" -lt 30 ]; then echo "no time left for $tool"; continue; fi
        timeout $(( $(left) - 10 )) SMOKE_SANITIZE=1 compute-sanitizer --tool $tool --print-limit 20 python3 /tmp/v4_smoke.py 5 \
          > "$OUT/sanitize_$tool.log" 2>&1
        echo "$tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|smoke:' "$OUT/sanitize_$tool.log" | tr '\n' ' ')"
        summary="$summary\n$tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.log" | tr '\n' ' ')"
      done;;
  esac
done
echo
echo "== summary ($(( $(date +%s) - T0 )) s)"
echo -e "$summary"
if [ -f "$OUT/bench.log" ]; then sed -n '/^| H | arm/,$p' "$OUT/bench.log"; fi
