"""Blockwise int8 quantisation of a flat float32 tensor, for the compressed outer
all-reduce (engine/buffer/outer_compress.py).

Each block of ``block`` consecutive values is sent as ``block`` int8 codes and one
float32 scale: ``scale = max|x| / 127`` over the block (1 where the block is all zero,
so nothing divides by zero), ``code = round(x / scale)`` (round half to even, as
``numpy.round``), ``x ~ code * scale``. The error per value is at most ``scale / 2``.

Codes and scales travel as one int8 tensor (:func:`pack`: the scales' bytes after the
codes), so one all-gather moves both. Every step is an elementwise float32 kernel, so
a NumPy float32 reimplementation gives the same bits (test/test_quantize.py).
"""

from __future__ import annotations

import paddle

INT8_MAX = 127
SCALE_BYTES = 4  # float32


def padded_numel(numel: int, block: int) -> int:
    """``numel`` rounded up to whole blocks (the tail block is zero-padded)."""
    return -(-numel // block) * block


def packed_numel(padded: int, block: int) -> int:
    """Bytes of one rank's packed message: the codes, then one float32 scale a block."""
    return padded + SCALE_BYTES * (padded // block)


def quantize(values: paddle.Tensor, block: int) -> tuple[paddle.Tensor, paddle.Tensor]:
    """``values``: flat float32, a whole number of blocks. Returns ``(codes, scales)``:
    int8 ``[n]`` and float32 ``[n / block]``."""
    grid = values.reshape([-1, block])
    amax = grid.abs().max(axis=1)
    scales = paddle.where(amax > 0, amax / INT8_MAX, paddle.ones_like(amax))
    codes = paddle.round(grid / scales.unsqueeze(1))
    # |x| / (amax / 127) may round to 127.00001: clip keeps it a valid code
    codes = paddle.clip(codes, -INT8_MAX, INT8_MAX).astype("int8")
    return codes.reshape([-1]), scales


def dequantize(codes: paddle.Tensor, scales: paddle.Tensor, block: int) -> paddle.Tensor:
    """Flat float32 ``codes * scale`` per block."""
    grid = codes.reshape([-1, block]).astype("float32")
    return (grid * scales.unsqueeze(1)).reshape([-1])


def pack(codes: paddle.Tensor, scales: paddle.Tensor) -> paddle.Tensor:
    """One int8 message: the codes, then the scales' bytes."""
    return paddle.concat([codes, scales.view(paddle.int8)])


def unpack(message: paddle.Tensor, padded: int) -> tuple[paddle.Tensor, paddle.Tensor]:
    """:func:`pack` undone: ``(codes, scales)`` of a message of ``padded`` codes."""
    return message[:padded], message[padded:].clone().view(paddle.float32)


def sum_of_messages(gathered: paddle.Tensor, nranks: int, padded: int, block: int,
                    lo: int = 0, hi: int | None = None) -> paddle.Tensor:
    """The float32 sum of every rank's dequantised message in ``gathered`` (``nranks``
    packed messages, rank order), of values ``[lo, hi)`` only (HFSDP: this rank's
    piece). Added in rank order on every rank, so every rank gets the same bits."""
    hi = padded if hi is None else hi
    first, last = lo // block, -(-hi // block)  # the blocks that hold [lo, hi)
    size = packed_numel(padded, block)
    def part(r: int) -> paddle.Tensor:
        codes, scales = unpack(gathered[r * size:(r + 1) * size], padded)
        return dequantize(codes[first * block:last * block], scales[first:last], block)

    total = part(0)
    for r in range(1, nranks):
        total = total + part(r)
    return total[lo - first * block:hi - first * block]
