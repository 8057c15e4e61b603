#!/usr/bin/env bash
# PaddleFormers' Trainer with HSDP 2 x 2 on 4 CPU ranks (tools/train_trainer.py): trains
# a small Llama, evaluates, saves; prints where. Flags go to HSDPTrainingArguments, e.g.
# `bash tools/train_trainer.sh --max_steps 100 --fsdp_outer_degree 1`.
set -uo pipefail
source "$(dirname "$0")/_env.sh" || exit 1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export GLOG_minloglevel=2
log_dir="$(mktemp -d -t hsdp_trainer_XXXX)"
echo "launching 4 CPU ranks (logs in $log_dir)"
"$PY" -m paddle.distributed.launch --nproc_per_node 4 --log_dir "$log_dir" \
  tools/train_trainer.py "$@" > "$log_dir/launch.out" 2>&1
rc=$?
grep -h -e "^\[trainer\]" -e "'loss'\|loss: " "$log_dir/workerlog.0" | grep -v DataLoad | \
  sed -e 's/\x1b\[[0-9;]*m//g' | grep -o -e "^\[trainer\].*" -e "loss: [0-9.]*.*global_step: [0-9]*"
if [ $rc -ne 0 ]; then
  tail -n 30 "$log_dir"/workerlog.* 2>/dev/null
  echo "failed (rc=$rc); logs in $log_dir"
fi
exit $rc
