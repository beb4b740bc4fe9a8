#!/usr/bin/env bash
# One device call comparing two checkouts, each with its own prebuilt programs: a baseline checkout ($BASE_DIR,
# default .build/base: kda_kcp, csrc, scripts, benchmarks, build.json of the older commit, e.g. from `git archive`)
# with its build ($BASE_BUILD, default .build/pb_main), and this tree with its build ($NEW_BUILD, default
# .build/pb_new), each made here by scripts/build_prebuilt.py. Each checkout loads only its own programs (their
# build identities name their sources), so this is how an A/B across source changes runs. STAGES, in order:
#   bitwise   o and every gradient of one det step (scripts/bitwise_builds.py) at each H in $BW_HEADS and gate law in
#             $BW_GATES (bench, strong; default bench), base vs new
#   tests     pytest -v $TEST_FILES on this tree (timeout $TEST_TIMEOUT; one line per test, so a run cut short still names each result)
#   sanitize  compute-sanitizer $SAN_TOOLS on $SAN_CMD (timeout $SAN_TIMEOUT each)
#   ab        the benchmark's det arm (H in $AB_HEADS, ops $AB_OPS, more arguments in $AB_ARGS, e.g. --gates strong) in
#             the order $AB_ORDER (base / new)
#   gap       scripts/profiling/host_gap.py (det, benchmark protocol against GPU-only time: the host's share of a cell)
#             at H in $GAP_HEADS, ops $GAP_OPS, in the order $AB_ORDER
#   timeline  scripts/profiling/timeline_step.py (one step with a workspace: its kernel span and each kernel's summed
#             time) at H in $TL_HEADS (default 4), op $TL_OP (default bwd), in the order $AB_ORDER
#   cmd       bash -c "$CMD" on this tree
# $BASE_ENV / $NEW_ENV: VAR=value words set for one side only (e.g. NEW_ENV="KDA_KCP_TUNING=fwd_warps=8": a knob the
# other checkout lacks, or an A/B of one knob with BASE_DIR the same tree's archive); the environment reaches both.
# Carry .whl and .build; logs come back in $OUT/logs.tgz, a summary last.
set -o pipefail
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
ROOT=$PWD
S=""
note() { S="$S\n$* ($(( $(date +%s) - T0 )) s)"; echo "$*"; }
BASE_DIR=${BASE_DIR:-.build/base}
arch=$(python3 -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'sm_{m}{n}a')")
mkdir -p "$BASE_DIR/kda_kcp/prebuilt/$arch" "kda_kcp/prebuilt/$arch"
cp "${BASE_BUILD:-.build/pb_main}/$arch/"*.so "$BASE_DIR/kda_kcp/prebuilt/$arch/"
cp "${NEW_BUILD:-.build/pb_new}/$arch/"*.so "kda_kcp/prebuilt/$arch/"
base() { (cd "$BASE_DIR" && env PYTHONPATH=$PWD:/tmp/site ${BASE_ENV:-} "$@"); }
new() { env PYTHONPATH=$ROOT:/tmp/site ${NEW_ENV:-} "$@"; }
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
for st in ${STAGES:-bitwise tests sanitize}; do
  case $st in
  bitwise)
    for law in ${BW_GATES:-bench}; do
      for h in ${BW_HEADS:-4 16}; do
        t=$law$h
        base python3 scripts/bitwise_builds.py save /tmp/ref$t.pt --heads $h --gates $law > $OUT/bw_save$t.log 2>&1 || note "base save H=$h $law failed: $(tail -3 $OUT/bw_save$t.log)"
        new python3 scripts/bitwise_builds.py cmp /tmp/ref$t.pt --heads $h --gates $law > $OUT/bw_cmp$t.log 2>&1
        note "bitwise H=$h $law gates rc=$?: $(cat $OUT/bw_cmp$t.log | tr '\n' ' ' | cut -c1-400)"
      done
    done;;
  tests)
    new timeout ${TEST_TIMEOUT:-330} python3 -m pytest -v -rfE --tb=short -p no:cacheprovider --durations=12 ${TEST_FILES:-tests/gpu/test_workspace_cuda.py tests/gpu/test_fwd_cuda.py tests/gpu/test_bwd_cuda.py} > $OUT/tests.log 2>&1
    grep -E " FAILED| ERROR|^E " $OUT/tests.log | head -30
    note "tests: $(tail -1 $OUT/tests.log)";;
  sanitize)
    for tool in ${SAN_TOOLS:-memcheck}; do
      new timeout ${SAN_TIMEOUT:-150} compute-sanitizer --tool $tool --print-limit 20 ${SAN_CMD:-python3 scripts/profile_step.py --heads 2 --docs 1 65 700 300} > $OUT/san_$tool.log 2>&1
      note "sanitize $tool rc=$?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $OUT/san_$tool.log | tr '\n' ' ')"
    done;;
  ab)
    for who in ${AB_ORDER:-base new base new}; do
      $who timeout 150 python3 benchmarks/bench_kda_kcp.py --world 1 --heads ${AB_HEADS:-16} --ops ${AB_OPS:-fwd bwd} --arms det --groups 2 --iters 5 --no-oracle ${AB_ARGS:-} > $OUT/ab_$who.log 2>&1
      note "ab $who: $(grep -E '^\| contiguous' $OUT/ab_$who.log | awk -F'|' '{printf "%s|%s|%s ; ", $3, $4, $5}')"
    done;;
  gap)
    for who in ${AB_ORDER:-base new base new}; do
      $who timeout 150 python3 $ROOT/scripts/profiling/host_gap.py --heads ${GAP_HEADS:-4} --op ${GAP_OPS:-fwd bwd} \
        --checkout . --tag $who > $OUT/gap_$who.log 2>&1
      note "gap $who: $(grep '^GAP' $OUT/gap_$who.log | cut -d' ' -f3- | tr '\n' ';')"
    done;;
  timeline)
    for who in ${AB_ORDER:-base new base new}; do
      for h in ${TL_HEADS:-4}; do
        $who timeout 120 python3 scripts/profiling/timeline_step.py --heads $h --op ${TL_OP:-bwd} --workspace \
          > $OUT/tl_$who$h.log 2>&1
        span=$(grep -E '^(fwd|bwd) H=' $OUT/tl_$who$h.log | cut -d, -f2)
        kernels=$(sed -n '/^time per kernel name/,$p' $OUT/tl_$who$h.log | grep -E 'walk|grads|prep|merge' | tr -s ' ' \
          | tr '\n' ';')
        note "timeline $who H=$h:$span; $kernels"
      done
    done;;
  cmd)
    new bash -c "$CMD" > $OUT/cmd.log 2>&1; note "cmd rc=$?: $(tail -5 $OUT/cmd.log | tr '\n' ' ')";;
  esac
done
echo -e "\n== summary $(( $(date +%s) - T0 )) s$S"
(cd $OUT && tar czf logs.tgz *.log && rm -f *.log)
