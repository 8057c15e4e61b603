#!/usr/bin/env bash
# Run every test: test/ (single process, fast) and test_collective/ (real CPU ranks
# launched with python -m paddle.distributed.launch on gloo). Extra args go to pytest,
# e.g. `bash tools/test.sh test/` or `bash tools/test.sh -k topology`.
set -uo pipefail
source "$(dirname "$0")/_env.sh" || exit 1
pytest_() { "$PY" -m pytest -q -p no:cacheprovider "$@"; }
# pytest exits 5 when it collects no test: that is not a failure.
ok() { [ "$1" -eq 0 ] || [ "$1" -eq 5 ]; }

if [ $# -gt 0 ]; then
  pytest_ "$@"
  rc=$?
  ok $rc && exit 0
  exit $rc
fi

# Both tiers side by side: the collective tier keeps about one of two cores busy on
# average (its ranks wait on each other, on etcd, on timeouts), which the single-process
# tier fills. Its report follows the collective tier's.
fast_log="$(mktemp -t hsdp_fast_tier_XXXXXX)"
pytest_ test > "$fast_log" 2>&1 &
fast=$!
trap 'kill $fast 2>/dev/null; rm -f "$fast_log"' EXIT
pytest_ test_collective
collective_rc=$?
wait $fast
fast_rc=$?
echo
echo "== test/ (single process), run beside test_collective/:"
cat "$fast_log"
ok $collective_rc && ok $fast_rc && exit 0
echo "test/ exited $fast_rc, test_collective/ $collective_rc"
exit 1
