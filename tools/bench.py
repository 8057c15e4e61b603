"""Side-by-side benchmark: paddle_hsdp against what Paddle users run today.

    python tools/bench.py                 # 73M LlamaLike, every variant, 2 alternating rounds
    python tools/bench.py --shape 140m    # the memory comparison
    python tools/bench.py --quick         # tiny model, one round (< 2 minutes; the tests run it)
    python tools/bench.py --two-hosts 100mbit   # 2 hosts x 2 ranks over a 100 Mbit/s link

Variants, on the same 4 CPU ranks (gloo), same model, data and steps, launched one at a
time and alternated round by round so that machine noise hits all of them alike:

* ``hsdp2x2`` / ``hsdp1x4``: paddle_hsdp, one unit per decoder layer plus the root;
* ``hfsdp2x2``: ``hsdp2x2`` with ``fsdp_outer_sharding: optim`` (the optimizer state
  sharded across the outer group too; its optimizer bytes per rank are reported);
* ``dp``: ``paddle.DataParallel``;
* ``stage3``: Paddle's ``GroupShardedStage3`` with ``segment_size=0`` (every parameter
  sharded, as paddle_hsdp does). Its entry point refuses CPU; the class runs with
  ``device="cpu"`` when its CUDA check is bypassed during construction, which the
  worker does (and says so). Its losses are checked against the others before its
  timings are reported;
* ``single``: one process on the whole batch (the loss reference).

Printed and written to ``OUT/bench.json`` (with ``loss.png``, ``bars.png`` and
``timeline.png``): median
step time (steps after the first) and its ratio to DataParallel and to stage 3; training
peak RSS per rank above the idle runtime (``FLAGS_use_system_allocator=true``, peak mark
reset after set-up) beside the theoretical per-rank figure; per-step wire bytes per
group kind from ``paddle_hsdp.comm.counter`` against the volume formulas (docs/architecture.md); and the last
loss's difference from the single process; for the hsdp variants, rank 0's memory
timeline (paddle_hsdp.engine.trace: the engine's bytes by kind at each of its events, and
the process RSS there), drawn in ``timeline.png``, with the breakdown at its peaks
printed. On a GPU machine compare against
``group_sharded_parallel(level="p_g_os")`` and ``paddle.distributed.fsdp`` instead of the
CPU bypass (not done here: no GPU).

``--two-hosts RATE`` (root and iproute2: ``tools/two_hosts.py``) runs ``dp``, ``stage3``,
``hsdp2x2``, ``hsdp2x2_bf16`` (bfloat16 reduce), ``hsdp2x2_int8`` and ``hfsdp2x2_int8``
(the outer sync as blockwise int8, its cross-host bytes against the fp32 run's),
``hfsdp2x2``, ``hsdp1x4`` and ``hsdp2x2_diloco16`` (DiLoCo: the replicas sync every 16
steps; run ``--steps 17`` so its timed window holds one sync; its step time is the
mean, the sync's included) on two
network-namespace hosts of 2 ranks each, joined by a link limited to RATE, on the 4M
model by default, and writes ``OUT/two_hosts.json``: median step time and its ratio to
DataParallel and stage 3, and the bytes that cross the link per step, (a) expected from the ranks' ring traffic
(paddle_hsdp's counter; for Paddle's own collectives the ring formula on the model's
sizes) and (b) measured on the veth (frames, and TCP payload with headers taken off).
The engine is copied into ``OUT/engine`` first and every launch imports that copy.

The pieces, one job a module, are in tools/benchkit/ (its __init__ lists them).
"""

from benchkit.cli import main

if __name__ == "__main__":
    main()
