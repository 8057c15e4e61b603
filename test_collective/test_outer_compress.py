"""The compressed outer sync (``MixedPrecisionPolicy(outer_compress="int8")``) on HSDP
2 x 2 and HFSDP 2 x 2, and ``"fp8"`` on HSDP 2 x 2 (4 CPU ranks, in the shared 2 x 2
launch): every step's parameters against a one-process simulation of the same
quantiser and error feedback (which, without the feedback, must miss), also across an
early sync that more micro-steps reopen; replicas bit-identical; the outer group's
bytes from the comm counter against the formula (workers/worker_outer_compress.py)."""


def test_outer_compress(hsdp_2x2_log):
    log = hsdp_2x2_log  # workers/worker_outer_compress.py, in the shared 2 x 2 launch
    for line in ("OUTER_COMPRESS parity hsdp:", "OUTER_COMPRESS replicas bit-identical",
                 "OUTER_COMPRESS hsdp bytes per step", "OUTER_COMPRESS hfsdp bytes per step",
                 "OUTER_COMPRESS hsdp fp8 bytes per step"):
        assert line in log, log[-3000:]
