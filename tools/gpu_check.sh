#!/usr/bin/env bash
# The first GPU run (issue 24): every check of tools/gpu_check.py on 2+ GPUs of one
# machine, then one table. Three launches, because two checks need a process of their own:
#   main           layout (fleet 1xN, mesh 2x(N/2)), overlap, profile, offload, bf16, mismatch
#   layouts        layout again with the layouts swapped (fleet 2x(N/2), mesh 1xN)
#   mismatch_hang  a rank gathers once more than the others: may end by the watchdog
# then `gpu_check.py --report OUT` prints the table and writes OUT/gpu_check.json.
#
#   bash tools/gpu_check.sh [--devices 0,1] [--out DIR] [--steps N] [--shape 73m]
#
# Python: $PYTHON, else python3; it needs a CUDA build of Paddle (pip install -e
# ".[gpu]"). Without 2+ GPUs it stops at once with status 2 and one line.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
# the engine, and the parity workers' TinyLM and measure, which the checks import
export PYTHONPATH="$ROOT:$ROOT/test_collective/workers${PYTHONPATH:+:$PYTHONPATH}"
export GLOG_minloglevel="${GLOG_minloglevel:-2}"

devices="" out="runs/gpu_check" pass=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help)
      "$PY" tools/gpu_check.py --help
      echo
      echo "tools/gpu_check.sh also takes --devices LIST (default: every visible GPU) and"
      echo "runs the launches above; --only, --layout and --phase are its to set."
      exit 0 ;;
    --devices) devices="$2"; shift 2 ;;
    --devices=*) devices="${1#*=}"; shift ;;
    --out) out="$2"; shift 2 ;;
    --out=*) out="${1#*=}"; shift ;;
    --only|--layout|--phase|--report|--only=*|--layout=*|--phase=*|--report=*)
      echo "gpu_check.sh: $1 is set by this script (run tools/gpu_check.py by hand for it)" >&2
      exit 2 ;;
    *) pass+=("$1"); shift ;;
  esac
done
# Bad flags and a missing GPU are reported once, here, before any launch.
rehearsal=0
for arg in ${pass[@]+"${pass[@]}"}; do [ "$arg" = --cpu-rehearsal ] && rehearsal=1; done
gpus="$("$PY" tools/gpu_check.py ${pass[@]+"${pass[@]}"} --preflight)" || exit $?
if [ $rehearsal = 1 ]; then  # CPU ranks on gloo: rehearses the script, measures nothing
  n=2 where=(--nproc_per_node 2) devices="2 CPU ranks"
else
  [ -n "$devices" ] || devices="$(seq -s, 0 $((gpus - 1)))"
  n=$(($(tr -cd , <<<"$devices" | wc -c) + 1))
  if [ "$n" -lt 2 ]; then
    echo "gpu_check: needs 2+ GPUs with a CUDA build of Paddle; --devices $devices names $n" >&2
    exit 2
  fi
  where=(--devices "$devices")
fi
if [ $((n % 2)) -eq 0 ]; then other="2x$((n / 2))"; else other="${n}x1"; fi
rm -rf "$out/results" "$out/logs" "$out/trace"   # this run's files only
mkdir -p "$out/logs"

launch() {  # launch PHASE SECONDS ARGS...: one launch, its exit status in logs/PHASE/rc
  local phase="$1" limit="$2"
  shift 2
  mkdir -p "$out/logs/$phase"
  echo "gpu_check: launch '$phase' on $devices (logs in $out/logs/$phase)"
  timeout -k 10 "$limit" "$PY" -m paddle.distributed.launch "${where[@]}" \
    --log_dir "$out/logs/$phase" tools/gpu_check.py --out "$out" --phase "$phase" \
    ${pass[@]+"${pass[@]}"} "$@" >"$out/logs/$phase/launch.out" 2>&1
  local rc=$?
  echo "$rc" >"$out/logs/$phase/rc"
  echo "gpu_check: launch '$phase' exited with status $rc"
}

start=$SECONDS
launch main 600
launch layouts 300 --layout "$other" --only layout
PADDLE_HSDP_COLLECTIVE_TIMEOUT="${PADDLE_HSDP_COLLECTIVE_TIMEOUT:-30}" \
  launch mismatch_hang 300 --only mismatch_hang
echo "gpu_check: $((SECONDS - start)) s of launches"
"$PY" tools/gpu_check.py --report "$out"
