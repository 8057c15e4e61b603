"""A Llama-shaped decoder for the benchmark: RMSNorm, causal multi-head attention with
q/k/v/o projections, SwiGLU MLP, untied embedding and head. The sizes give the
parameter counts the engine issue measured PaddleFormers Llama at (hidden 1024:
6 layers ~74M, 12 layers ~141M), without a network download; "4m" (4.0M) is the
slow-link benchmark's model.
"""

from __future__ import annotations

from dataclasses import dataclass

import paddle
import paddle.nn as nn
import paddle.nn.functional as F


@dataclass(frozen=True)
class Shape:
    vocab: int
    hidden: int
    layers: int
    heads: int
    intermediate: int
    seq: int

    def params(self) -> int:
        h, i = self.hidden, self.intermediate
        per_layer = 4 * h * h + 3 * h * i + 2 * h
        return 2 * self.vocab * h + self.layers * per_layer + h

    def layer_params(self) -> int:
        return 4 * self.hidden ** 2 + 3 * self.hidden * self.intermediate + 2 * self.hidden

    def activation_bytes_per_layer(self, batch: int) -> int:
        """fp32 bytes a layer's backward keeps per sequence (Korthikanti et al.'s
        34sbh + 5as^2b for 16-bit, doubled for float32)."""
        s, h, a = self.seq, self.hidden, self.heads
        return 2 * batch * (34 * s * h + 5 * a * s * s)


SHAPES = {
    "tiny": Shape(vocab=512, hidden=64, layers=2, heads=4, intermediate=160, seq=32),
    # the slow-link benchmark's (--two-hosts): small enough that compute (~2 GFLOP per
    # sequence and step) does not hide what 16 MB of fp32 grads take on a 100 Mbit/s link
    "4m": Shape(vocab=4000, hidden=256, layers=3, heads=4, intermediate=512, seq=128),
    "73m": Shape(vocab=3000, hidden=1024, layers=6, heads=16, intermediate=2304, seq=128),
    "140m": Shape(vocab=3000, hidden=1024, layers=12, heads=16, intermediate=2304, seq=128),
}


class RMSNorm(nn.Layer):
    def __init__(self, h):
        super().__init__()
        self.weight = self.create_parameter([h], default_initializer=nn.initializer.Constant(1.0))

    def forward(self, x):
        return x * paddle.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * self.weight


class DecoderLayer(nn.Layer):
    def __init__(self, s: Shape):
        super().__init__()
        h = s.hidden
        self.heads = s.heads
        self.input_norm = RMSNorm(h)
        self.q_proj = nn.Linear(h, h, bias_attr=False)
        self.k_proj = nn.Linear(h, h, bias_attr=False)
        self.v_proj = nn.Linear(h, h, bias_attr=False)
        self.o_proj = nn.Linear(h, h, bias_attr=False)
        self.post_norm = RMSNorm(h)
        self.gate_proj = nn.Linear(h, s.intermediate, bias_attr=False)
        self.up_proj = nn.Linear(h, s.intermediate, bias_attr=False)
        self.down_proj = nn.Linear(s.intermediate, h, bias_attr=False)

    def forward(self, x):
        b, t, h = x.shape
        y = self.input_norm(x)
        q, k, v = (p(y).reshape([b, t, self.heads, h // self.heads]).transpose([0, 2, 1, 3])
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        scores = paddle.matmul(q, k, transpose_y=True) / (h // self.heads) ** 0.5
        mask = paddle.triu(paddle.full([t, t], float("-inf")), diagonal=1)
        attn = paddle.matmul(F.softmax(scores + mask, axis=-1), v)
        x = x + self.o_proj(attn.transpose([0, 2, 1, 3]).reshape([b, t, h]))
        y = self.post_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


class LlamaLike(nn.Layer):
    def __init__(self, s: Shape):
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab, s.hidden)
        self.layers = nn.LayerList([DecoderLayer(s) for _ in range(s.layers)])
        self.norm = RMSNorm(s.hidden)
        self.lm_head = nn.Linear(s.hidden, s.vocab, bias_attr=False)
        self.vocab = s.vocab

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def build(shape: Shape, seed: int = 1234) -> LlamaLike:
    paddle.seed(seed)
    return LlamaLike(shape)


def loss_of(model, ids):
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape([-1, logits.shape[-1]]), ids[:, 1:].reshape([-1, 1]))
