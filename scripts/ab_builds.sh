#!/usr/bin/env bash
# One device call that compares kernel builds (each a folder of scripts/build_prebuilt.py's layout, built here and
# carried): GPU tests on one build, o and gradients bitwise between builds, ncu of chosen kernels in the order
# given, and the benchmark's det arm in the order given. Full logs under $OUT; a summary last.
#
#   BUILDS="M=.build/prebuilt E=.build/pb_e"   name=folder pairs (required)
#   TEST_ON=E  TEST_FILES="tests/gpu/test_bwd_cuda.py"      the GPU tests, on one build (empty: none)
#   BITWISE="M E"                  the first build is the reference, each other is compared with it (empty: none)
#   NCU_ORDER="M E E M"  NCU_KERNELS=grads_kernel  NCU_COUNT=2   ncu durations (ms) of each launch, per visit
#   AB_ORDER="M E M E"  AB_HEADS=16  AB_OPS=bwd                 bench_kda_kcp.py --arms det --no-oracle, per visit
#   ERR_ON="M E"                   errors against the FP64 oracle on the benchmark's accuracy slice, per build
#   BUDGET=540                      seconds for the whole call; a stage with too little time left is skipped
#
# Device command (carry .whl and every build folder):
#   BUILDS="M=.build/prebuilt E=.build/pb_e" TEST_ON=E BITWISE="M E" NCU_ORDER="M E E M" AB_ORDER="M E M E" \
#     bash scripts/ab_builds.sh
set -o pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/apache*.whl \
  && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
left() { echo $(( ${BUDGET:-540} - ($(date +%s) - T0) )); }
arch=$(python3 -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'sm_{m}{n}a')")
declare -A DIR
for pair in ${BUILDS:?BUILDS=\"NAME=folder ...\" is required}; do DIR[${pair%%=*}]=${pair#*=}; done
use() {
  [ -d "${DIR[$1]}/$arch" ] || { echo "no build $1 for $arch (${DIR[$1]})"; exit 2; }
  mkdir -p "kda_kcp/prebuilt/$arch" && cp "${DIR[$1]}/$arch/"*.so "kda_kcp/prebuilt/$arch/"
}
S=""
note() { S="$S\n$* ($(( $(date +%s) - T0 )) s)"; }
if [ -n "${TEST_ON:-}" ]; then
  use "$TEST_ON"
  timeout $(( $(left) > 40 ? $(left) - 30 : 10 )) python3 -m pytest -q -x -p no:cacheprovider \
    ${TEST_FILES:-tests/gpu/test_bwd_cuda.py} > "$OUT/tests_$TEST_ON.log" 2>&1
  note "tests $TEST_ON: $(tail -1 "$OUT/tests_$TEST_ON.log")"
fi
for b in ${ERR_ON:-}; do
  use "$b"
  timeout 120 python3 benchmarks/bench_kda_kcp.py --world 1 --heads 4 --ops fwd --arms det --groups 1 --iters 1 \
    > "$OUT/err_$b.log" 2>&1
  note "errors $b: $(grep -E '^\| contiguous +\| det' "$OUT/err_$b.log" | head -1 | tr -s ' ')"
done
set -- ${BITWISE:-}
if [ $# -ge 2 ]; then
  ref=$1; shift
  use "$ref"; python3 scripts/bitwise_builds.py save /tmp/bitwise_ref.pt --heads "${AB_HEADS%% *}" > "$OUT/bitwise.log" 2>&1
  for b in "$@"; do
    use "$b"; echo "== $b vs $ref" >> "$OUT/bitwise.log"
    python3 scripts/bitwise_builds.py cmp /tmp/bitwise_ref.pt --heads "${AB_HEADS%% *}" >> "$OUT/bitwise.log" 2>&1
    note "bitwise $b vs $ref: $(grep -c 'bitwise equal' "$OUT/bitwise.log") equal so far, $(grep -c DIFFERS "$OUT/bitwise.log") differ"
  done
fi
i=0
for b in ${NCU_ORDER:-}; do
  [ "$(left)" -lt 60 ] && { note "ncu: out of time"; break; }
  use "$b"; i=$((i + 1))
  timeout 120 ncu --clock-control none -k "regex:${NCU_KERNELS:-grads_kernel}" --launch-count "${NCU_COUNT:-2}" \
    --section SpeedOfLight python3 scripts/profile_step.py --heads "${AB_HEADS%% *}" > "$OUT/ncu_${i}_$b.log" 2>&1
  note "ncu $b: $(grep -E '^ +Duration' "$OUT/ncu_${i}_$b.log" | awk '{print $NF}' | tr '\n' ' ')"
done
i=0
for b in ${AB_ORDER:-}; do
  [ "$(left)" -lt 45 ] && { note "ab: out of time"; break; }
  use "$b"; i=$((i + 1))
  timeout $(( $(left) - 10 )) python3 benchmarks/bench_kda_kcp.py --world 1 --heads ${AB_HEADS:-16} \
    --ops ${AB_OPS:-bwd} --arms det --groups 2 --iters 5 --no-oracle > "$OUT/ab_${i}_$b.log" 2>&1
  note "ab $b: $(grep -E '^\| contiguous' "$OUT/ab_${i}_$b.log" | awk -F'|' '{printf "H=%s %s %s ms; ", $3, $4, $5}')"
done
echo -e "$S"
(cd "$OUT" && tar czf logs.tgz *.log && rm -f *.log)
