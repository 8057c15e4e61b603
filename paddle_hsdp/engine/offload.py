"""CPU offload: shards, their grads and the optimizer state live in host memory that
the optimizer owns; all-gathers, compute and reductions run on the device; explicit
copies move data between the two.

Why explicit copies, and why the host storage is never pinned: on a device build,
Paddle 3.3 runs a kernel given a pinned host tensor on the device, copying the input
there and re-pointing the pinned tensor at the device copy (``phi`` data transform).
An in-place add into pinned grads would leave the optimizer's ``.grad`` views on the
old host memory, and moments created for such params would land on the device. So:

* **Host storage** (``flat``, ``flat_grad``, ``flat_main_grad`` of a buffer) is plain
  ``CPUPlace`` memory; every kernel that touches it sees only CPU tensors and runs on
  the CPU, under :func:`on_host` (``paddle.set_device("cpu")``, as Paddle's own
  ``GroupShardedOptimizerStage2`` offload does), so whatever it creates is on the host.
* **Upload** before each all-gather (and the outer all-reduce): one host-to-device copy
  into a device tensor the collective sends and then drops (with ``pin_memory``
  through pinned staging, asynchronously; from pageable memory CUDA synchronises the
  stream first).
* **Download** after each reduction: with ``pin_memory`` a non-blocking copy into a
  pinned staging tensor, recorded with an event; without it a blocking copy. The host
  side (a CPU add or assign into the grad storage) runs when the host next reads the
  grads, after **one** wait for the newest download (copies on one stream complete in
  order): :meth:`HostStorage.settle`, which :func:`settle_all` runs for every buffer
  before the optimizer step.
* **The optimizer step** runs under :func:`on_host`: accumulators, master weights and the
  learning-rate tensor are created on the host and every update kernel runs on the CPU.
  One optimizer must update only offloaded or only device shards (:func:`host_step`).

On a CPU-only build there is nothing to offload from and the policy is a no-op, unless
:data:`EXERCISE_ON_CPU` is set (tests): then host and "device" are both the CPU and every
upload and download is a real copy, so the bookkeeping above runs and can be counted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import paddle

from ..comm import watchdog
from .context import OffloadCounters, context

if TYPE_CHECKING:
    from paddle.base.core import Place

EXERCISE_ON_CPU = False  # tests: run the offload path with the CPU as the device


def counters() -> OffloadCounters:
    """What moved and how often we waited (:func:`reset_counters` zeroes them)."""
    return context.offload.counters


def reset_counters() -> None:
    context.offload.counters = OffloadCounters()


def enabled(policy: object | None) -> bool:
    """Whether ``policy`` (an offload policy or None) moves shards to the host here."""
    if policy is None or not getattr(policy, "offloads_to_host", False):
        return False
    return EXERCISE_ON_CPU or not paddle.get_device().startswith("cpu")


def compute_device() -> str:
    """The device collectives and compute run on, also inside :func:`on_host`."""
    stack = context.offload.device_stack
    return stack[-1] if stack else paddle.get_device()


@contextlib.contextmanager
def on_host() -> Iterator[None]:
    """Create tensors on (and so run new ops on) the host for the block."""
    device, stack = paddle.get_device(), context.offload.device_stack
    if device.startswith("cpu"):
        stack.append(compute_device())
        try:
            yield
        finally:
            stack.pop()
        return
    stack.append(device)
    paddle.set_device("cpu")
    try:
        yield
    finally:
        paddle.set_device(device)
        stack.pop()


@contextlib.contextmanager
def on_device() -> Iterator[None]:
    """Inside :func:`on_host`: back on the compute device for the block (a collective)."""
    stack = context.offload.device_stack
    if not stack or paddle.get_device() == stack[-1]:
        yield
        return
    paddle.set_device(stack[-1])
    try:
        yield
    finally:
        paddle.set_device("cpu")


def to_compute_device(t: paddle.Tensor) -> paddle.Tensor:
    """``t`` on the compute device (a copy when it is elsewhere)."""
    device = compute_device()
    if device.startswith("cpu") and t.place.is_cpu_place():
        return t
    return t._copy_to(_place(device), True)


@dataclass
class _Download:
    target: paddle.Tensor   # host storage
    staged: paddle.Tensor   # the downloaded copy (pinned or CPU)
    add: bool               # add into target, else assign
    seq: int                # issue order: downloads on one stream complete in order
    event: paddle.device.Event | None  # recorded after a non-blocking copy




def _wait_for(download: _Download) -> None:
    """Make sure ``download`` (and every older one) is complete: one wait, unless a
    wait for a newer one already covered it."""
    if download.seq <= context.offload.completed:
        return
    if download.event is not None:
        with watchdog.host_sync("the wait for offloaded grads' device-to-host copies"):
            download.event.synchronize()
    context.offload.counters.waits += 1
    context.offload.completed = download.seq


class HostStorage:
    """The host side of one offloaded buffer: its storage is created here, and every
    copy between it and the device goes through :meth:`upload` and :meth:`download`."""

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = bool(pin_memory)
        self.device = compute_device()
        self._downloads: list[_Download] = []
        self._uploads: list[tuple] = []  # (pinned staging, event) of copies in flight

    # ---------------------------------------------------------------- storage
    def zeros(self, numel: int, dtype: paddle.dtype) -> paddle.Tensor:
        with on_host():
            return paddle.zeros([numel], dtype)

    def keep(self, t: paddle.Tensor) -> paddle.Tensor:
        """A host copy of ``t`` that the host side owns from now on (blocking)."""
        return t._copy_to(paddle.CPUPlace(), True)

    # ---------------------------------------------------------------- transfers
    def upload(self, host: paddle.Tensor) -> paddle.Tensor:
        """A device copy of ``host`` for a collective to send (the host stays put).
        From pageable memory the copy synchronises its stream; with ``pin_memory`` it
        goes through pinned staging (a host memcpy) and runs asynchronously, the
        staging kept alive until its event says the copy is done."""
        counted = context.offload.counters
        counted.uploads += 1
        counted.upload_bytes += _nbytes(host)
        place = _place(self.device)
        if not (self.pin_memory and not self.device.startswith("cpu")):
            return host._copy_to(place, True)
        staged = host._copy_to(paddle.CUDAPinnedPlace(), True)
        out = staged._copy_to(place, False)
        event = paddle.device.Event()
        event.record()
        self._uploads = [(s, e) for s, e in self._uploads if not e.query()]
        self._uploads.append((staged, event))
        return out

    def download(self, device_tensor: paddle.Tensor, into: paddle.Tensor, add: bool) -> None:
        """Bring ``device_tensor`` into host storage ``into`` (added, or assigned),
        completed by the next :meth:`settle`. A download still pending for ``into`` (a
        micro-step earlier: its copy is long done) is settled first, so at most one
        copy per target is in flight."""
        if any(d.target is into for d in self._downloads):
            self.settle()
        counted = context.offload.counters
        counted.downloads += 1
        counted.download_bytes += _nbytes(device_tensor)
        event = None
        if self.pin_memory and not self.device.startswith("cpu"):
            staged = device_tensor._copy_to(paddle.CUDAPinnedPlace(), False)
            event = paddle.device.Event()
            event.record()  # on the current stream, after the copy
        else:
            staged = device_tensor._copy_to(paddle.CPUPlace(), True)
        context.offload.issued += 1
        self._downloads.append(_Download(into, staged, add, context.offload.issued, event))

    def pending(self) -> int:
        return len(self._downloads)

    def newest(self) -> _Download | None:
        return self._downloads[-1] if self._downloads else None

    def settle(self) -> None:
        """Wait for this buffer's newest download (no wait when a wait for a newer one
        covered it), then fold every pending one into host storage, in order."""
        if not self._downloads:
            return
        downloads, self._downloads = self._downloads, []
        _wait_for(downloads[-1])
        with on_host():
            for d in downloads:
                staged = d.staged
                if not staged.place.is_cpu_place():  # pinned: kernels must see CPU memory
                    staged = staged._copy_to(paddle.CPUPlace(), True)
                if staged.dtype != d.target.dtype:
                    staged = staged.astype(d.target.dtype)
                if d.add:
                    d.target.add_(staged.reshape(d.target.shape))
                else:
                    paddle.assign(staged.reshape(d.target.shape), output=d.target)

    def drop(self) -> None:
        """Forget pending downloads (clear_grad, a failed backward): their copies are
        waited for, their values not used."""
        downloads, self._downloads = self._downloads, []
        if downloads:
            _wait_for(downloads[-1])


class _Buffer(Protocol):
    """What :func:`settle_all` and :func:`host_step` read of a buffer (a
    ``ShardBuffer``, which imports this module)."""

    @property
    def host(self) -> HostStorage | None: ...

    def describe(self) -> str: ...


def settle_all(buffers: Iterable[_Buffer]) -> None:
    """Every pending download of ``buffers`` folded into host storage, after one wait
    (for the newest of them: the older ones completed before it)."""
    hosts = [b.host for b in buffers if b.host is not None and b.host.pending()]
    newest = [d for d in (host.newest() for host in hosts) if d is not None]
    if not newest:
        return
    _wait_for(max(newest, key=lambda d: d.seq))
    for host in hosts:
        host.settle()


@contextlib.contextmanager
def host_step(buffers: Iterable[_Buffer], what: str = "the optimizer step") -> Iterator[None]:
    """Run an optimizer step over ``buffers``' shards: on the host when they are
    offloaded (after every pending download is in), as is when none is; a mix is
    refused, before anything is updated."""
    buffers = list(buffers)
    offloaded = [b for b in buffers if b.host is not None]
    if not offloaded:
        yield
        return
    if len(offloaded) != len(buffers):
        on_device_ = next(b for b in buffers if b.host is None)
        raise NotImplementedError(
            f"{what}: this optimizer updates shards offloaded to CPU memory "
            f"({offloaded[0].describe()}) and shards on the device "
            f"({on_device_.describe()}); one optimizer steps in one place. Give every "
            "unit it updates the same offload_policy (CPUOffloadPolicy or none), or use "
            "one optimizer per kind.")
    settle_all(offloaded)
    context.offload.counters.host_steps += 1
    with on_host():
        yield


def _place(device: str) -> Place:
    if device.startswith("cpu"):
        return paddle.CPUPlace()
    kind, _, number = device.partition(":")
    index = int(number or 0)
    if kind == "gpu":
        return paddle.CUDAPlace(index)
    if kind == "xpu":
        return paddle.XPUPlace(index)
    return paddle.CustomPlace(kind, index)


def _nbytes(t: paddle.Tensor) -> int:
    size = 1
    for d in t.shape:
        size *= int(d)
    return size * t.element_size()
