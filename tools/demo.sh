#!/usr/bin/env bash
# The main job: 4 CPU ranks, HSDP 2 x 2 (2 replicas of 2-way shards) on gloo.
set -uo pipefail
source "$(dirname "$0")/_env.sh" || exit 1
log_dir="$(mktemp -d -t hsdp_demo_XXXX)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export GLOG_minloglevel=2
echo "[demo] launching 4 CPU ranks (logs in $log_dir)"
HSDP_DEMO_REPORT="$log_dir/report.txt" "$PY" -m paddle.distributed.launch \
  --nproc_per_node 4 --log_dir "$log_dir" tools/demo.py "$@" > "$log_dir/launch.out" 2>&1
rc=$?
if [ $rc -ne 0 ]; then
  tail -n 30 "$log_dir"/workerlog.* 2>/dev/null
  echo "demo failed (rc=$rc); logs in $log_dir"
fi
cat "$log_dir/report.txt" 2>/dev/null
exit $rc
