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

# Three pytest processes side by side: the collective tier as two streams
# (test_collective/conftest.py, --collective-stream): "shared", whose shared launches keep
# the cores busy, and "own", whose tests start jobs of their own and mostly wait on them
# (timeouts, leases, an etcd away by design), with test/ (single process) filling what
# is left. Each stream's Paddle launches pick ports in a range of their own (PORT_RANGE,
# below the kernel's ephemeral ports), so the two never pick the same port. "shared" and
# test/ run at a lower priority (nice): what "own" needs, it gets at once (its ranks'
# heartbeats and timeouts are timed; it is the longer of the two), the others the rest.
# The reports of "own" and test/ follow that of "shared".
own_log="$(mktemp -t hsdp_own_stream_XXXXXX)"
fast_log="$(mktemp -t hsdp_fast_tier_XXXXXX)"
yielding() { renice -n $(($(nice) + 4)) -p $BASHPID > /dev/null; "$@"; }  # 4 nicer, in its subshell
(yielding pytest_ test) > "$fast_log" 2>&1 &
fast=$!
PORT_RANGE=21000:32000 pytest_ test_collective --collective-stream own > "$own_log" 2>&1 &
own=$!
trap 'kill $fast $own 2>/dev/null; rm -f "$fast_log" "$own_log"' EXIT
(export PORT_RANGE=10000:20999; yielding pytest_ test_collective --collective-stream shared)
shared_rc=$?
wait $own
own_rc=$?
wait $fast
fast_rc=$?
echo
echo "== test_collective/, the tests with jobs of their own, run beside the shared launches:"
cat "$own_log"
echo
echo "== test/ (single process), run beside test_collective/:"
cat "$fast_log"
ok $shared_rc && ok $own_rc && ok $fast_rc && exit 0
echo "test/ exited $fast_rc, test_collective/ $shared_rc (shared launches), $own_rc (own jobs)"
exit 1
