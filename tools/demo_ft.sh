#!/usr/bin/env bash
# Fault-tolerant HSDP: three replica groups of 2 CPU ranks around a coordinator; one is
# killed mid-run and started again, the others keep training (tools/demo_ft.py;
# --steps, --kill-at, --restart-after, --replicas; --help lists them).
set -uo pipefail
source "$(dirname "$0")/_env.sh" || exit 1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export GLOG_minloglevel=2
"$PY" tools/demo_ft.py "$@" 2> >(grep -v -e "ccache" -e "warnings.warn" >&2)
