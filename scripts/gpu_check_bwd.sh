#!/usr/bin/env bash
# One device call for the CUDA backward: install the carried wheels, put the prebuilt kda_bwd.so in place
# (or JIT-build it there), run tests/gpu/test_bwd_cuda.py, then time our backward (bwd_grads: prep, forward
# walk, reverse walk, chunk gradients) on the benchmark batch (docs 42024 57573 73122 88673, T = 261392)
# at H = 4, 16, 64. Logs go under $OUT; a short table is printed last.
#
#   carry: [".whl", ".build/bwd"]     (.build/bwd/sm_90a/kda_bwd.so from
#          `python scripts/build_prebuilt.py --arch sm_90a --program kda_bwd --out .build/bwd` on a machine with nvcc)
#   usage: scripts/gpu_check_bwd.sh [tests] [sanitize] [bench-heads "4 16 64"] [bench]   (default: tests bench)
set -o pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
arch=$(python3 -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'sm_{m}{n}a')")
if [ -f ".build/bwd/$arch/kda_bwd.so" ]; then
  mkdir -p "kda_kcp/prebuilt/$arch" && cp ".build/bwd/$arch/kda_bwd.so" "kda_kcp/prebuilt/$arch/kda_bwd.so"
else
  echo "no prebuilt kda_bwd.so for $arch: JIT build"
  python3 -c "import torch; from kda_kcp.cuda import backward as b; b.load(torch.device('cuda'))" || exit 1
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
stages=${*:-tests bench}
heads="4 16 64"
summary=""
set -- $stages
while [ $# -gt 0 ]; do
  case "$1" in
    tests)
      timeout 150 python3 -m pytest -q -s tests/gpu/test_bwd_cuda.py 2>&1 | tee "$OUT/tests_bwd.log" \
        | grep -E "seed|rel-RMS|vs |passed|failed|Error|error|assert" | head -70
      summary="$summary\ntests: $(tail -1 "$OUT/tests_bwd.log")";;
    bench-heads) shift; heads="$1";;
    sanitize)  # the stage diagnostics and the segmentation test under compute-sanitizer memcheck
      timeout 200 compute-sanitizer --tool memcheck --print-limit 20 python3 -m pytest -q -s -x \
        tests/gpu/test_bwd_cuda.py -k "stages or segmentations" 2>&1 | tee "$OUT/sanitize_bwd.log" | tail -30
      summary="$summary\nsanitize: $(grep -E 'ERROR SUMMARY' "$OUT/sanitize_bwd.log" | tail -1)";;
    bench)
      cat > /tmp/bench_bwd.py <<'PY'
import json, os, sys, torch
sys.path.insert(0, '.')
from kda_kcp.plan import LocalPlan, build_plan
from kda_kcp.cuda import backward as cb
heads = [int(x) for x in sys.argv[1].split()]
lens = [42024, 57573, 73122, 88673]
cu = [0]
for n in lens: cu.append(cu[-1] + n)
T = cu[-1]
plan = LocalPlan(T, build_plan(cu, [[(0, T)]]).rank_runs[0])
flush = torch.empty(256 << 20, dtype=torch.uint8, device='cuda')
rows = []
for H in heads:
    gen = torch.Generator(device='cuda').manual_seed(H)
    q = torch.nn.functional.normalize(torch.randn(T, H, 128, device='cuda', generator=gen), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(T, H, 128, device='cuda', generator=gen), dim=-1).bfloat16()
    v = torch.randn(T, H, 128, device='cuda', generator=gen).bfloat16()
    g = (-5 * torch.sigmoid(torch.randn(T, H, 128, device='cuda', generator=gen))).clamp(-5, -1e-6)
    beta = torch.rand(T, H, device='cuda', generator=gen).bfloat16().clamp(0.01, 0.99)
    do = torch.randn(T, H, 128, device='cuda', generator=gen).bfloat16()
    med = lambda xs: sorted(xs)[len(xs) // 2]
    cb.bwd_grads(q, k, v, g, beta, do, 128 ** -0.5, plan); torch.cuda.synchronize()
    times = {}
    for it in range(5):
        flush.zero_(); torch.cuda.synchronize()
        d = {}
        cb.bwd_grads(q, k, v, g, beta, do, 128 ** -0.5, plan, timing=d)
        for n, t in d.items(): times.setdefault(n, []).append(t)
    tot = times.pop('total'); segc = times.pop('seg_chunks')[0]
    unsplit = float('nan')
    if H == 4:  # the same with whole-run walks, to see what segmenting buys
        os.environ['KDA_KCP_BWD_SEG_CHUNKS'] = '0'
        cb.bwd_grads(q, k, v, g, beta, do, 128 ** -0.5, plan); ts = []
        for it in range(3):
            flush.zero_(); torch.cuda.synchronize(); d = {}
            cb.bwd_grads(q, k, v, g, beta, do, 128 ** -0.5, plan, timing=d); ts.append(d['total'])
        unsplit = med(ts)
        del os.environ['KDA_KCP_BWD_SEG_CHUNKS']
    ent = {}
    for det in (True, False):
        ts = []
        for it in range(3):
            flush.zero_(); torch.cuda.synchronize()
            a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
            a.record(); cb.bwd_grads(q, k, v, g, beta, do, 128 ** -0.5, plan, None, None, det); b.record()
            torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
        ent['det' if det else 'nd'] = med(ts)
    row = dict(H=H, seg_chunks=segc, total_ms=med(tot), unsplit_total_ms=unsplit, **{n: med(t) for n, t in times.items()}, entry_det_ms=ent['det'], entry_nd_ms=ent['nd'],
               peak_gib=torch.cuda.max_memory_allocated() / 2**30)
    rows.append(row); print(json.dumps(row), flush=True)
    del q, k, v, g, beta, do
    torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
fla = {4: 14.8, 16: 47.8}
print("\n| H | seg chunks | bwd total ms | (whole-run walks) | prep | fwd summ+fold | fwd walk | rev summ+fold | rev walk | grads | entry det | entry nd | FLA 0.6.0 (measured earlier) | peak GiB |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['H']} | {r['seg_chunks']} | {r['total_ms']:.2f} | {r['unsplit_total_ms']:.2f} | {r['prep']:.2f} | {r['fwd_summaries']:.2f} | {r['fwd_walk']:.2f} | "
          f"{r['rev_summaries']:.2f} | {r['rev_walk']:.2f} | {r['grads']:.2f} | "
          f"{r['entry_det_ms']:.2f} | {r['entry_nd_ms']:.2f} | {fla.get(r['H'], float('nan'))} | {r['peak_gib']:.1f} |")
PY
      timeout 120 python3 /tmp/bench_bwd.py "$heads" 2>&1 | tee "$OUT/bench_bwd.log" | tail -8
      summary="$summary\n$(grep '^|' "$OUT/bench_bwd.log")";;
  esac
  shift
done
echo -e "$summary"
