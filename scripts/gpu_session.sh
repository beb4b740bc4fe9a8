#!/usr/bin/env bash
# One device call: set up a bare GPU machine, then run the stages named as arguments, in order, each
# under what is left of the call's budget ($BUDGET seconds, default 540). Full logs go under $OUT; a
# short summary comes last.
#
#   warm       start FLA's Triton compiles in the background (scripts/warm_fla_cache.py, one process per
#              head count in $HEADS, on the last GPU; WARM_CP=1 adds FLA's CP path, two ranks per head
#              count); bench stages wait for them
#   tests      the one-GPU tests: tests/gpu/test_workspace_cuda.py, test_fwd_cuda.py, test_bwd_cuda.py
#              (or the files in $TEST_FILES), one pytest process per file
#   nccl       tests/gpu/test_kcp_nccl.py (W = 2 over NCCL, or W = $KDA_KCP_TEST_WORLD; needs that many GPUs)
#   bench1     benchmarks/bench_kda_kcp.py --world 1 --heads $HEADS (ops $OPS, arms det nd control fla)
#   bench2     benchmarks/bench_kda_kcp.py --world ${WORLD2:-2} --heads $HEADS2 (all layouts, arms + fla_cp)
#   ab         the backward's det arm at H in $HEADS under each KDA_KCP_TUNING value in $AB_TUNING (forced
#              tuning choices, kda_kcp/cuda/tuning.py; default: the gradient kernel's warps, "bwd_grads_warps=8
#              bwd_grads_warps=16"), no FLA, no oracle
#   ncu        Nsight Compute on one call of each v4 forward and backward kernel at H = 16 (or each H in $NCU_HEADS)
#   ncu_src    Nsight Compute, every section and per-instruction stall samples, on the kernels in $NCU_KERNELS
#              (names joined by |), summed per phase by scripts/profiling/stall_regions.py
#   sanitize   compute-sanitizer memcheck, racecheck, initcheck on one small fwd + bwd (scripts/profile_step.py)
#   demo       python -m kda_kcp.demo (the README's main command)
#   cache      pack Triton's cache (binaries, metadata, autotune results) into $OUT/triton-cache-xz-part-* (xz); carry
#              them back into .build/triton-cache/
#
# Setup (always): install the carried wheels (.whl), copy the prebuilt .so files from .build/prebuilt/<arch>
# (built without a GPU: scripts/build_prebuilt.py; or from $PREBUILT/<arch>: carry several build folders and
# run the stages once per folder to compare builds), unpack .build/triton-cache.tgz and the parts in
# .build/triton-cache/ (xz, or gzip from older parts) if carried.
# Logs are packed into $OUT/logs.tgz at the end (the device returns at most 8 files).
# Device command, from the repository root, carrying .whl, .build/prebuilt, .build/triton-cache:
#   bash scripts/gpu_session.sh warm tests nccl bench1 cache
set -o pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
HEADS=${HEADS:-4 16 64}; HEADS2=${HEADS2:-$HEADS}; OPS=${OPS:-fwd bwd ckpt}
left() { echo $(( ${BUDGET:-540} - ($(date +%s) - T0) )); }
# a stage's timeout: what is left minus a margin, at least 5 s (a negative value made `timeout` fail outright)
tl() { local t=$(( $(left) - $1 )); [ "$t" -lt 5 ] && t=5; echo "$t"; }
arch=$(python3 -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'sm_{m}{n}a')")
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
PREBUILT=${PREBUILT:-.build/prebuilt}  # another folder of the same layout: an A/B between builds
if [ -d "$PREBUILT/$arch" ]; then
  mkdir -p "kda_kcp/prebuilt/$arch" && cp "$PREBUILT/$arch"/*.so "kda_kcp/prebuilt/$arch/"
fi
mkdir -p ~/.triton
if [ -f .build/triton-cache.tgz ]; then tar xzf .build/triton-cache.tgz -C ~/.triton; fi
# the cache stage's parts: xz (cache-xz-part-*, ~30x smaller than the tree: 200 MB -> 7 MB) or gzip (older parts)
xzp=$(ls .build/triton-cache/*xz-part-* 2> /dev/null); gzp=$(ls .build/triton-cache/*part-* 2> /dev/null | grep -v xz-part)
# xz on a pipe, through Python's lzma where the machine has no xz binary
xzc() { if command -v xz > /dev/null; then xz -6 -T0; else python3 -c "import lzma, shutil, sys
with lzma.open(sys.stdout.buffer, 'w') as f: shutil.copyfileobj(sys.stdin.buffer, f)"; fi; }
xzcat() { if command -v xz > /dev/null; then xz -dc; else python3 -c "import lzma, shutil, sys
with lzma.open(sys.stdin.buffer) as f: shutil.copyfileobj(f, sys.stdout.buffer)"; fi; }
[ -n "$xzp" ] && cat $xzp | xzcat | tar xf - -C ~/.triton
[ -n "$gzp" ] && cat $gzp | tar xzf - -C ~/.triton
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.mem,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"
summary=""
add() { summary="$summary\n$*"; }
warm_pids=()
wait_warm() {
  for p in "${warm_pids[@]}"; do wait "$p"; done
  warm_pids=()
  [ -f "$OUT/warm.log" ] && add "warm: $(grep -c 'warm_fla_cache:' "$OUT/warm.log") compiles done, $(( $(date +%s) - T0 )) s into the call"
}
for st in "$@"; do
  echo "== $st ($(left) s left)"
  case "$st" in
    warm)
      for h in $HEADS; do
        timeout $(tl 60) python3 scripts/warm_fla_cache.py --heads "$h" --device $(( ngpu - 1 )) \
          >> "$OUT/warm.log" 2>&1 &
        warm_pids+=($!)
        if [ "${WARM_CP:-0}" = 1 ] && [ "$ngpu" -ge "${WORLD2:-2}" ]; then  # FLA's CP kernels too (WORLD2 ranks)
          timeout $(tl 60) python3 scripts/warm_fla_cache.py --cp --world "${WORLD2:-2}" --heads "$h" \
            --port $(( 29700 + h )) \
            >> "$OUT/warm.log" 2>&1 &
          warm_pids+=($!)
        fi
      done;;
    tests)
      # one pytest process per file: a file whose tests pass only after another file's calls (a process's first
      # call, made lazily) fails as it would in a user's process
      for f in ${TEST_FILES:-tests/gpu/test_workspace_cuda.py tests/gpu/test_fwd_cuda.py tests/gpu/test_bwd_cuda.py}; do
        timeout $(tl 30) python3 -m pytest -q -s -p no:cacheprovider --durations=8 "$f" >> "$OUT/tests.log" 2>&1
        add "tests $(basename "$f"): $(tail -1 "$OUT/tests.log")"
      done
      grep -E "rel|vs |passed|failed|Error|assert" "$OUT/tests.log" | tail -40;;
    nccl)
      if [ "$ngpu" -lt "${KDA_KCP_TEST_WORLD:-2}" ]; then add "nccl: skipped ($ngpu GPU)"; continue; fi
      timeout $(tl 30) python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_kcp_nccl.py \
        > "$OUT/nccl.log" 2>&1
      grep -E "FAILED|W=[0-9]+ o|passed|failed|ok$" "$OUT/nccl.log" | tail -40
      add "nccl: $(tail -1 "$OUT/nccl.log")";;
    bench1)
      wait_warm
      timeout $(tl 20) python3 benchmarks/bench_kda_kcp.py --world 1 --heads $HEADS --ops $OPS \
        --arms det nd control fla ${BENCH_ARGS:-} --json "$OUT/bench_w1.json" --plot "$OUT/bench_w1.png" \
        > "$OUT/bench_w1.log" 2>&1
      add "bench1 rc=$?"; tail -45 "$OUT/bench_w1.log";;
    bench2)
      wait_warm
      if [ "$ngpu" -lt "${WORLD2:-2}" ]; then add "bench2: skipped ($ngpu GPU)"; continue; fi
      timeout $(tl 20) python3 benchmarks/bench_kda_kcp.py --world "${WORLD2:-2}" --heads $HEADS2 --ops $OPS \
        ${BENCH2_ARGS:-} --json "$OUT/bench_w2.json" --plot "$OUT/bench_w2.png" > "$OUT/bench_w2.log" 2>&1
      add "bench2 rc=$?"; tail -60 "$OUT/bench_w2.log";;
    ab)
      i=0
      for v in ${AB_TUNING:-bwd_grads_warps=8 bwd_grads_warps=16}; do
        i=$((i + 1))
        KDA_KCP_TUNING="$v" timeout $(tl 20) python3 benchmarks/bench_kda_kcp.py \
          --world 1 --heads $HEADS --ops ${AB_OPS:-bwd} --arms det --groups 2 --iters 5 --no-oracle \
          --json "$OUT/ab_$i.json" > "$OUT/ab_$i.log" 2>&1
        add "ab $i KDA_KCP_TUNING=$v rc=$?: $(grep -E '^\| ' "$OUT/ab_$i.log" | tail -4 | tr '\n' ' ')"
      done;;
    ncu)  # one fwd + bwd per head count in $NCU_HEADS (default 16) -> $OUT/ncu.log (16) or ncu_h$H.log
      for nh in ${NCU_HEADS:-16}; do
        log="$OUT/ncu.log"; [ "$nh" = 16 ] || log="$OUT/ncu_h$nh.log"
        timeout $(tl 20) ncu --clock-control none --launch-skip 0 --launch-count 12 \
          --kernel-name-base demangled -k "regex:prep_kernel|walk_kernel|grads_kernel|fold_kernel|merge_kernel" --section SpeedOfLight --section Occupancy \
          --section LaunchStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
          python3 scripts/profile_step.py --heads "$nh" > "$log" 2>&1
        add "ncu H=$nh rc=$?"; grep -E "^  [a-z_].*\(|Duration" "$log" | paste - - | sed -E 's/ +/ /g' | cut -c1-150
      done;;
    ncu_src)  # the full section set with source-line sampling for the kernels in $NCU_KERNELS (one launch each)
      timeout $(tl 40) ncu --clock-control none --set full --import-source yes \
        --kernel-name-base demangled -k "regex:${NCU_KERNELS:-grads_kernel}" --launch-count ${NCU_COUNT:-1} \
        -o /tmp/src python3 scripts/profile_step.py --heads 16 > "$OUT/ncu_src.log" 2>&1
      add "ncu_src rc=$?"
      ncu -i /tmp/src.ncu-rep --page details --print-details all > "$OUT/ncu_details.txt" 2>&1
      ncu -i /tmp/src.ncu-rep --page source --csv --print-source sass > "$OUT/ncu_sass.csv" 2>&1
      IFS='|' read -ra names <<< "${NCU_KERNELS:-grads_kernel}"
      for k in "${names[@]}"; do python3 scripts/profiling/stall_regions.py "$OUT/ncu_sass.csv" --kernel "$k" | tee -a "$OUT/stall_regions.md"; done;;
    sanitize)  # compute-sanitizer on one small fwd + bwd (segmented walks forced), each tool as time allows
      for tool in memcheck racecheck initcheck; do
        if [ "$(left)" -lt 40 ]; then add "sanitize $tool: no time left"; continue; fi
        KDA_KCP_TUNING=fwd_seg_chunks=2,bwd_seg_chunks=2 timeout $(tl 20) compute-sanitizer --tool $tool \
          --print-limit 20 python3 scripts/profile_step.py --heads 2 --docs 1 65 700 300 > "$OUT/sanitize_$tool.log" 2>&1
        add "sanitize $tool rc=$?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.log" | tr '\n' ' ')"
      done;;
    demo)
      timeout 120 python3 -m kda_kcp.demo > "$OUT/demo.log" 2>&1; add "demo rc=$?: $(tail -2 "$OUT/demo.log" | tr '\n' ' ')";;
    cache)
      wait_warm
      # binaries, metadata and autotune results only (what a cache hit reads), xz-compressed (the cubins
      # compress ~30x), in parts under the 16 MiB limit; carry them back into .build/triton-cache/
      (cd ~/.triton && find cache -type f \( -name '*.cubin' -o -name '*.json' -o -name '*.so' \) | tar cf - -T - \
        | xzc | split -b 15m - "$OUT/triton-cache-xz-part-") \
        && add "cache: $(du -ch "$OUT"/triton-cache-xz-part-* | tail -1 | cut -f1)";;
    *) echo "unknown stage $st"; exit 2;;
  esac
done
wait_warm
echo
echo "== summary ($(( $(date +%s) - T0 )) s)"
echo -e "$summary"
for f in "$OUT"/bench_w1.log "$OUT"/bench_w2.log; do [ -f "$f" ] && sed -n '/^| /p' "$f" | head -60; done
(cd "$OUT" && tar czf logs.tgz $(ls | grep -v -e '^triton-cache-' -e '\.png$') && find . -maxdepth 1 -type f \
  ! -name logs.tgz ! -name 'triton-cache-*' ! -name '*.png' -delete)
