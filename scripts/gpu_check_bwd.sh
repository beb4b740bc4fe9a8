#!/usr/bin/env bash
# One device call for the CUDA backward: install the carried wheels, put the prebuilt kda_bwd.so in place
# (or JIT-build it there), run tests/gpu/test_bwd_cuda.py, then time our backward (bwd_grads: prep, forward
# walk, reverse walk, chunk gradients) on the benchmark batch (docs 42024 57573 73122 88673, T = 261392)
# at H = 4, 16, 64. Logs go under $OUT; a short table is printed last.
#
#   carry: [".whl", ".build/bwd"]     (.build/bwd/sm_90a/kda_bwd.so from
#          `python -m kda_kcp.cuda.backward --build sm_90a --out .build/bwd` on a machine with nvcc)
#   usage: scripts/gpu_check_bwd.sh [tests] [bench] [bench-heads "4 16 64"]
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
    bench)
      cat > /tmp/bench_bwd.py <<'PY'
import json, sys, torch
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
    mod = cb.load(q.device)
    chunks, runs = cb._tables(plan, q.device)
    nc = chunks.shape[0]
    prep = torch.empty(nc * H * cb.PREP_BYTES, dtype=torch.uint8, device='cuda')
    h = torch.empty(nc, H, 128, 128, dtype=torch.float32, device='cuda'); dh = torch.empty_like(h)
    dq, dk, dv, dg, db = (torch.empty_like(x) for x in (q, k, v, g, beta))
    e0 = torch.empty(0, device='cuda')
    stages = [
        ('prep', lambda: mod.bwd_prep(q, k, v, g, beta, chunks, prep, 128 ** -0.5)),
        ('fwd_walk', lambda: mod.bwd_fwd_walk(prep, chunks, runs, e0, h)),
        ('rev_walk', lambda: mod.bwd_rev_walk(do, prep, chunks, runs, e0, dh)),
        ('grads', lambda: mod.bwd_grads(q, k, v, g, beta, do, chunks, prep, h, dh, dq, dk, dv, dg, db, 128 ** -0.5)),
    ]
    for _, f in stages: f()
    torch.cuda.synchronize()
    times = {n: [] for n, _ in stages}; tot = []
    for it in range(5):
        flush.zero_(); torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(stages) + 1)]
        ev[0].record()
        for i, (n, f) in enumerate(stages):
            f(); ev[i + 1].record()
        torch.cuda.synchronize()
        for i, (n, _) in enumerate(stages): times[n].append(ev[i].elapsed_time(ev[i + 1]))
        tot.append(ev[0].elapsed_time(ev[-1]))
    med = lambda xs: sorted(xs)[len(xs) // 2]
    del prep, h, dh, dq, dk, dv, dg, db
    torch.cuda.empty_cache()
    # the public entry (allocations included), det and nondet
    for det in (True, False):
        cb.bwd_grads(q, k, v, g, beta, do, 128 ** -0.5, plan, None, None, det); torch.cuda.synchronize()
    ent = {}
    for det in (True, False):
        ts = []
        for it in range(3):
            flush.zero_(); torch.cuda.synchronize()
            a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
            a.record(); cb.bwd_grads(q, k, v, g, beta, do, 128 ** -0.5, plan, None, None, det); b.record()
            torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
        ent['det' if det else 'nd'] = med(ts)
    row = dict(H=H, total_ms=med(tot), **{n: med(t) for n, t in times.items()}, entry_det_ms=ent['det'], entry_nd_ms=ent['nd'],
               peak_gib=torch.cuda.max_memory_allocated() / 2**30)
    rows.append(row); print(json.dumps(row), flush=True)
    del q, k, v, g, beta, do
    torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
fla = {4: 14.8, 16: 47.8}
print("\n| H | bwd total ms | prep | fwd walk | rev walk | grads | entry det | entry nd | FLA 0.6.0 (measured earlier) | peak GiB |")
print("|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['H']} | {r['total_ms']:.2f} | {r['prep']:.2f} | {r['fwd_walk']:.2f} | {r['rev_walk']:.2f} | {r['grads']:.2f} | "
          f"{r['entry_det_ms']:.2f} | {r['entry_nd_ms']:.2f} | {fla.get(r['H'], float('nan'))} | {r['peak_gib']:.1f} |")
PY
      timeout 120 python3 /tmp/bench_bwd.py "$heads" 2>&1 | tee "$OUT/bench_bwd.log" | tail -8
      summary="$summary\n$(grep '^|' "$OUT/bench_bwd.log")";;
  esac
  shift
done
echo -e "$summary"
