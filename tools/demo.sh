#!/usr/bin/env bash
# The main job: train a small causal LM with HSDP 2 x 2 (2 replicas of 2-way shards)
# on 4 CPU ranks (gloo). Arguments go to tools/demo.py (--steps, --micro, --batch, ...;
# --help lists them).
set -uo pipefail
source "$(dirname "$0")/_env.sh" || exit 1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export GLOG_minloglevel=2
# The flags are checked once, here, before any rank starts: a bad one is reported once
# (not by 4 ranks), and --help prints them and exits.
PYTHONPATH="$ROOT/tools:$PYTHONPATH" "$PY" -c 'import sys; sys.argv[0] = "tools/demo.sh"
import demo; demo.parse_args()' "$@" 2> >(grep -v -e "ccache" -e "warnings.warn" >&2) || exit $?
for arg in "$@"; do case "$arg" in -h|--help) exit 0 ;; esac; done
log_dir="$(mktemp -d -t hsdp_demo_XXXX)"
echo "launching 4 CPU ranks (logs in $log_dir)"
"$PY" -m paddle.distributed.launch --nproc_per_node 4 --log_dir "$log_dir" \
  tools/demo.py "$@" > "$log_dir/launch.out" 2>&1 &
launcher=$!
# Rank 0 writes its report ([demo] lines) and progress bar to its worker log: follow it
# until the launch ends, the bar redrawn on one line.
for _ in $(seq 300); do [ -f "$log_dir/workerlog.0" ] && break; sleep 0.2; done
tail -n +1 -f --pid=$launcher "$log_dir/workerlog.0" 2>/dev/null | tr '\r' '\n' | awk '
  /^\[demo\] / { if (bar) printf "\n"; bar = 0; sub(/^\[demo\] /, ""); print; fflush(); next }
  /^train:/     { printf "\r%s", $0; bar = 1; fflush() }
  END           { if (bar) printf "\n" }'
wait $launcher
rc=$?
if [ $rc -ne 0 ]; then
  tail -n 30 "$log_dir"/workerlog.* 2>/dev/null
  echo "demo failed (rc=$rc); logs in $log_dir"
fi
exit $rc
