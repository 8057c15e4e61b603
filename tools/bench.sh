#!/usr/bin/env bash
# Side-by-side benchmark (paddle_hsdp 2x2 / 1x4, DataParallel, Paddle stage 3, one
# process) on 4 CPU ranks; see tools/bench.py --help. Sets up .venv/ like the others.
set -uo pipefail
source "$(dirname "$0")/_env.sh" || exit 1
exec "$PY" tools/bench.py "$@"
