"""Blockwise 8-bit quantisation of a flat float32 tensor, for the compressed outer
all-reduce (engine/buffer/outer_compress.py).

Each block of ``block`` consecutive values is sent as ``block`` one-byte codes and one
float32 scale: ``scale = max|x| / top`` over the block (1 where the block is all zero,
so nothing divides by zero), ``x ~ code * scale``. Two kinds of code:

* ``"int8"``: ``top = 127``, ``code = round(x / scale)`` (round half to even, as
  ``numpy.round``); the error per value is at most ``scale / 2``;
* ``"fp8"``: ``top = 448``, ``code`` = ``x / scale`` cast to float8 e4m3 (Paddle's
  ``float8_e4m3fn``, round to nearest even): a relative error of at most 2^-4 per
  value, so small values of a block keep more of their digits than in int8 (values
  below ``2^-9 scale`` are flushed to zero).

Codes and scales travel as one int8 tensor (:func:`pack`: the codes' bytes, then the
scales' bytes), so one all-gather moves both. Every step is an elementwise float32 kernel
or a cast, so a NumPy reimplementation (``ml_dtypes`` for float8) gives the same bits
(test/test_quantize.py).
"""

from __future__ import annotations

import paddle

INT8_MAX = 127
FP8_MAX = 448.0  # float8 e4m3's largest finite value
KINDS = ("int8", "fp8")
SCALE_BYTES = 4  # float32


def padded_numel(numel: int, block: int) -> int:
    """``numel`` rounded up to whole blocks (the tail block is zero-padded)."""
    return -(-numel // block) * block


def packed_numel(padded: int, block: int) -> int:
    """Bytes of one rank's packed message: the codes, then one float32 scale a block."""
    return padded + SCALE_BYTES * (padded // block)


def quantize(values: paddle.Tensor, block: int, kind: str = "int8",
             ) -> tuple[paddle.Tensor, paddle.Tensor]:
    """``values``: flat float32, a whole number of blocks. Returns ``(codes, scales)``:
    ``[n]`` one-byte codes as int8 (float8 codes' bytes for ``"fp8"``) and float32
    ``[n / block]``."""
    top = INT8_MAX if kind == "int8" else FP8_MAX
    grid = values.reshape([-1, block])
    amax = grid.abs().max(axis=1)
    scales = paddle.where(amax > 0, amax / top, paddle.ones_like(amax))
    scaled = grid / scales.unsqueeze(1)
    # |x| / (amax / top) may round to just above top: clip keeps it a valid code
    if kind == "int8":
        codes = paddle.clip(paddle.round(scaled), -INT8_MAX, INT8_MAX).astype("int8")
    else:
        codes = paddle.clip(scaled, -FP8_MAX, FP8_MAX).astype(paddle.float8_e4m3fn) \
            .view(paddle.int8)
    return codes.reshape([-1]), scales


def dequantize(codes: paddle.Tensor, scales: paddle.Tensor, block: int,
               kind: str = "int8") -> paddle.Tensor:
    """Flat float32 ``code * scale`` per block."""
    if kind == "fp8":
        codes = codes.view(paddle.float8_e4m3fn)
    grid = codes.reshape([-1, block]).astype("float32")
    return (grid * scales.unsqueeze(1)).reshape([-1])


def pack(codes: paddle.Tensor, scales: paddle.Tensor) -> paddle.Tensor:
    """One int8 message: the codes, then the scales' bytes."""
    return paddle.concat([codes, scales.view(paddle.int8)])


def unpack(message: paddle.Tensor, padded: int) -> tuple[paddle.Tensor, paddle.Tensor]:
    """:func:`pack` undone: ``(codes, scales)`` of a message of ``padded`` codes."""
    return message[:padded], message[padded:].clone().view(paddle.float32)


def sum_of_messages(gathered: paddle.Tensor, nranks: int, padded: int, block: int,
                    lo: int = 0, hi: int | None = None, kind: str = "int8") -> paddle.Tensor:
    """The float32 sum of every rank's dequantised message in ``gathered`` (``nranks``
    packed messages, rank order), of values ``[lo, hi)`` only (HFSDP: this rank's
    piece). Added in rank order on every rank, so every rank gets the same bits."""
    hi = padded if hi is None else hi
    first, last = lo // block, -(-hi // block)  # the blocks that hold [lo, hi)
    size = packed_numel(padded, block)
    def part(r: int) -> paddle.Tensor:
        codes, scales = unpack(gathered[r * size:(r + 1) * size], padded)
        return dequantize(codes[first * block:last * block], scales[first:last], block, kind)

    total = part(0)
    for r in range(1, nranks):
        total = total + part(r)
    return total[lo - first * block:hi - first * block]
