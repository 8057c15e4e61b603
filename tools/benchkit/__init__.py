"""tools/bench.py's pieces, one job a module (the command line and its documentation:
tools/bench.py):

* ``settings``: the variants, the world size, the two-host targets, the paths;
* ``launch``: one variant's launch (one host, or two), the alternating rounds;
* ``summary``: a one-host run's figures, the theoretical bytes per rank, the loss check;
* ``cross_host``: a two-host run's figures: the bytes across the link, the targets;
* ``tables``: the printed tables; ``plots``: loss.png, bars.png, timeline.png;
* ``cli``: the flags and the two runs.

Imported with tools/ on sys.path (``python tools/bench.py`` puts it there)."""
