"""tools/gpu_check.py's pieces, one job a module (the command line and its documentation:
tools/gpu_check.py):

* ``options``: the flags, the checks' names, the layouts;
* ``preflight``: a CUDA build with 2+ GPUs, the workers' modules importable;
* ``run``: what a launch's checks share (rank, layouts, data, reference);
* ``parity_checks``: layout, offload, bf16 against their references;
* ``speed_checks``: overlap on / off, the profiler trace;
* ``mismatch_checks``: ranks calling units in different orders, recorded per rank;
* ``kernels``: GPU kernels from a profiler result or a trace, comm under compute;
* ``placement``: where an optimizer's tensors live;
* ``mismatch_outcomes``: the records and watchdog lines judged into rows;
* ``table``: rows, the table, the exit status; ``report``: ``--report OUT``;
* ``cli``: ``main``, one launch's loop over the checks.

Imported with tools/ on sys.path (``python tools/gpu_check.py`` and its launches put it
there)."""
