"""A model built under paddle.LazyGuard() is materialised one parameter at a time while
it is sharded: no rank ever holds the full model. Peak RSS says so.

Model: 32 x Linear(1024, 1024) = 128 MiB of float32; 2 ranks, inner 2 -> 64 MiB of
shards per rank. Measured first, in a fresh process (Paddle's allocator keeps freed
memory cached, so a later measurement would see reused memory, not the real need);
then a plain full-size allocation shows the measurement does see the model when it is
really allocated (128 MiB).
"""

import ctypes
import os

# RSS must follow the live tensors, or it measures allocators, not what the engine holds:
# * Paddle's caching allocator keeps every freed full-size parameter's block, fragmented
#   by the shards cut from them (111-123 MiB peak here, 1.04-1.15x under the bound), so
#   tensors go to malloc (set before paddle is imported);
# * glibc then serves them from its heap once a freed mmap'd block has raised its dynamic
#   mmap threshold, and the heap fragments the same way (131 MiB seen on one rank): a
#   fixed threshold keeps every block of 128 KiB or more mmap'd, returned when freed.
os.environ["FLAGS_use_system_allocator"] = "true"
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 * 1024)

from common import finish, init_fleet  # noqa: E402

import paddle  # noqa: E402
import paddle.distributed as dist  # noqa: E402

import paddle_hsdp  # noqa: E402

LAYERS, WIDTH = 32, 1024
MB = 2 ** 20


def rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def lazy_build_and_shard() -> tuple[int, object]:
    reset_peak()
    base = rss("VmRSS")
    with paddle.LazyGuard():
        model = paddle.nn.Sequential(*[paddle.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    for layer in model:
        paddle_hsdp.fully_shard(layer)
    paddle_hsdp.fully_shard(model)
    return rss("VmHWM") - base, model


def full_size_allocation_peak(nbytes: int) -> int:
    reset_peak()
    base = rss("VmRSS")
    t = paddle.ones([nbytes // 4], dtype="float32")  # touched: really resident
    peak = rss("VmHWM") - base
    del t
    return peak


init_fleet({"sharding_degree": 2, "outer": 1})
full_bytes = LAYERS * (WIDTH * WIDTH + WIDTH) * 4
lazy_peak, model = lazy_build_and_shard()
held = paddle_hsdp.memory_report(model)["shard"]
control = full_size_allocation_peak(full_bytes)
print(f"LAZY rank {dist.get_rank()}: full model {full_bytes / MB:.0f} MiB, shards "
      f"{held / MB:.0f} MiB; peak RSS growth while building under LazyGuard and sharding "
      f"{lazy_peak / MB:.0f} MiB; a plain full-size tensor {control / MB:.0f} MiB", flush=True)
assert held * 2 >= full_bytes and held < 0.51 * full_bytes, held
assert control > 0.9 * full_bytes, control  # the measurement can see a full model
assert lazy_peak < full_bytes, (lazy_peak, full_bytes)  # never the full model
model(paddle.randn([4, WIDTH])).mean().backward()  # the materialised shards train
finish()
