"""``save_checkpoint``: every rank decides alone which of its boxes it writes
(checkpoint/plan.py: each distinct box once, the writing balanced by bytes over the
ranks that hold it, nothing exchanged), writes them into one file of
``CKPT.tmp-<token>``, and sends rank 0 its manifest; rank 0 checks that the pieces
tile every tensor, writes the metadata and renames the directory into place (an older
``CKPT`` is replaced only then), and tells every rank the outcome. A failure on any
rank leaves the previous checkpoint as it was and raises on every rank.

Three collectives, whatever the world size: rank 0's token and its check of the path
(a broadcast), the manifests to rank 0, the outcome (a broadcast). The manifests go
as files: each rank writes its manifest's JSON into the save's temporary folder
(``.manifests/``), and one fixed-size gather brings rank 0 each rank's file rank,
length and CRC (24 bytes a rank), so rank 0 reads exactly each rank's bytes (not W
times the longest, as a padded gather would send) and the other ranks receive
nothing. Boxes of one name that overlap without being equal (two EP ranks' local
experts without global indices) are refused by rank 0's check, and the written files
removed. Boxes written twice (a tied layer on two pipeline stages) are kept once.
"""

from __future__ import annotations

import atexit
import glob
import hashlib
import json
import os
import shutil
import sys
import threading
import time
import zlib
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, cast

import numpy as np
from safetensors.numpy import save_file

from ..comm.arrival import expect_everyone
from ..comm.traits import traits_of
from .boxes import tiling_error
from .format import (FORMAT, META, CheckpointError, broadcast_json, chunk_rows,
                     gather_sizes_to_root, rank_world, read_metadata)
from .items import all_items
from .plan import Write, plan_writes
from .rules import crc_header, grids, group_id, place_of, rule_of, slice_box

if TYPE_CHECKING:
    import paddle

    from ..engine.holdings import Holdings
    from .items import Item


class JointSaver(Protocol):
    """The live replica groups of a fault-tolerant job saving one checkpoint together
    (paddle_hsdp.ft.joint_save.JointSave, which checkpoint does not import)."""

    @property
    def world_size(self) -> int: ...
    def begin(self, path: str) -> str: ...
    def writes(self, piece: int | None) -> bool: ...
    def file_rank(self) -> int: ...
    def gather(self, payload: dict) -> list | None: ...
    def announce(self, outcome: str) -> None: ...
    def outcome(self) -> str: ...
    def resume_state(self) -> dict | None: ...


def _write_rank_file(path: str, tensors: dict, header: dict | None = None) -> None:
    save_file(tensors, path, metadata=header or None)
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def save_checkpoint(path: str | os.PathLike, model: paddle.nn.Layer,
                    optimizer: paddle.optimizer.Optimizer | None = None, extra: Any = None,
                    async_save: bool = False, trainable_only: bool = False) -> AsyncSave | None:
    """Save ``model`` (and ``optimizer``, and JSON-serialisable ``extra``) to the
    directory ``path``. A collective: call it on every rank. See the module docstring.

    ``trainable_only=True`` leaves the frozen parameters (``stop_gradient``) out: LoRA
    adapters over a base model that a resume reads from the base model's own files;
    load such a checkpoint with ``load_checkpoint(..., trainable_only=True)``.

    ``async_save=True`` returns once this rank's pieces are copied to host memory, with
    an :class:`AsyncSave`: a thread writes the files while training goes on, and the
    checkpoint is published (rank 0's check and index, the rename, every rank told the
    outcome) by its ``wait()``, a collective; the next ``save_checkpoint`` or
    ``load_checkpoint``, or the process's exit, waits for it if you do not. Until then
    ``path`` holds the previous checkpoint, and a failure leaves it as it was."""
    if not isinstance(async_save, bool):
        raise TypeError(f"save_checkpoint: async_save must be True or False, got "
                        f"{async_save!r}")
    if extra is not None:
        json.dumps(extra)  # not serialisable: TypeError here, on every rank alike
    wait_for_pending_save()  # a previous async save is published first (every rank)
    path = os.path.abspath(os.fspath(path))
    rank, world = rank_world()
    items, holdings = all_items(model, optimizer, "save_checkpoint", trainable_only)
    call = f"save_checkpoint({path!r})"
    expect_everyone(None, call)
    joint = _joint_save(holdings)  # a fault-tolerant job: the live replica groups save together
    if joint is not None and async_save:  # (every rank alike, before any collective)
        raise NotImplementedError(
            "save_checkpoint(async_save=True) in a fault-tolerant job: the replica groups "
            "publish together from the round they share, which may change before wait(); "
            "use async_save=False")
    token = joint.begin(path) if joint is not None else None
    start = broadcast_json({"token": token or f"{time.time_ns() % 2 ** 62:x}",
                             "refusal": _guarded(_refusal_to_replace, path)}
                            if rank == 0 else None, call)
    # what the metadata records besides the tensors, as of this call (an async save
    # publishes later, after the scheduler has stepped on)
    lr = getattr(holdings.optimizer, "_learning_rate", None)
    plain = json.loads(json.dumps({
        "lr_scheduler": lr.state_dict() if lr is not None and hasattr(lr, "state_dict")
        else None,
        "extra": extra}, default=float))
    save = AsyncSave(path, f"{path}.tmp-{token or start['token']}", joint,
                     (items, plain, holdings, world))
    save.error = start["refusal"]
    if save.error is None:
        try:
            held = [it for it in items if not it.empty and
                    (joint is None or joint.writes(it.piece))]
            # jointly, which group writes is the joint save's: its outer replicas
            # (the other groups) are not this group's to choose among
            drop = ("outer",) if joint is not None else ()
            # HFSDP's optimizer rows: each rank writes its own, indexed by rule (a
            # fault-tolerant job's buffers share their pieces: items.py sets no spot,
            # so a joint save lists every box)
            ruled = [it for it in items if it.spot is not None]
            writes = plan_writes([it for it in held if it.spot is None],
                                 drop_axes=drop) + ruled_writes(ruled)
            save.rules = describe_rules(ruled, holdings.stage, rank)  # (a rank's empty rows too)
            save.staged = _stage(writes)  # host copies: training may go on
            # the first holder of each box vouches that it exists: rank 0 refuses a save
            # where no holder's plan wrote it (plans that disagreed)
            save.expected = sorted({it.name for it in held
                                    if it.replicas.without(drop).index == 0})
            # what a resume of the job needs beyond tensors (step, RNG, scheduler, the
            # user's state), from the ranks of the group that writes the replicated boxes
            save.resume = joint.resume_state() if joint is not None else None
        except Exception as e:  # every rank must learn of it: rank 0 says it below
            save.error = f"rank {rank}: {type(e).__name__}: {e}"
    if not async_save:
        save.write()
        save.wait()
        return None
    save.start()
    _pending.append(save)
    return save


# The async save not yet published (at most one: the next save or load waits for it).
# Module state: a save outlives the call that started it.
_pending: list[AsyncSave] = []
_exit_hook: list[Callable[[], None]] = []  # at_exit, once registered


def wait_for_pending_save() -> None:
    """Publish the async save still in flight, if any (a collective: every rank)."""
    while _pending:
        _pending[0].wait()


_failed_exit = [False]  # an exception is ending this process (sys.excepthook saw it)


def _at_exit() -> None:
    """An async save left at exit is published then (a collective), unless this process
    ends on an error: the others may still be training, and would not meet it in that
    collective. Then its file is finished and left unpublished (the previous checkpoint
    stays)."""
    if _failed_exit[0]:
        for save in list(_pending):
            if save._thread is not None:
                save._thread.join()
        return
    wait_for_pending_save()


def _install_exit_hook() -> None:
    if _exit_hook:
        return
    previous = sys.excepthook

    def note_failure(*args: Any) -> None:
        _failed_exit[0] = True
        previous(*args)
    sys.excepthook = note_failure
    _exit_hook.append(atexit.register(_at_exit))


class AsyncSave:
    """A save whose files a thread writes (``save_checkpoint(..., async_save=True)``).
    :meth:`wait` (every rank) finishes it: the manifests to rank 0, which checks and
    publishes, the outcome to every rank; it raises ``CheckpointError`` if the save
    failed anywhere (the previous checkpoint then stays)."""

    def __init__(self, path: str, tmp: str, joint: JointSaver | None, what: tuple) -> None:
        self.path, self.tmp, self.joint, self._what = path, tmp, joint, what
        self.error: str | None = None
        self.staged: list[tuple[Write[Item], np.ndarray]] = []
        self.pieces: list = []
        self.expected: list = []  # names of boxes this rank is the first holder of
        self.rules: dict = {}  # the rules this rank leads (checkpoint/rules.py)
        self.resume: dict | None = None  # jointly: this rank's resume state, if it gives it
        self._thread: threading.Thread | None = None
        self._done = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self.write, daemon=True,
                                        name="paddle_hsdp-checkpoint-write")
        self._thread.start()
        _install_exit_hook()  # an async save left at exit is published then

    def write(self) -> None:
        """This rank's file (no collective: safe on a thread)."""
        if self.error is not None:
            return
        rank = rank_world()[0]
        try:
            self.pieces = _write_pieces(
                self.tmp, self.joint.file_rank() if self.joint is not None else rank,
                self.staged)
        except Exception as e:
            self.error = f"rank {rank}: {type(e).__name__}: {e}"
        self.staged = []  # the host copies go once written

    def done(self) -> bool:
        """Whether this rank's file is written (``wait`` still publishes)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        if self._done:
            return
        self._done = True
        if self in _pending:
            _pending.remove(self)
        if self._thread is not None:
            self._thread.join()
        _finish(self)


def _finish(save: AsyncSave) -> None:
    """Every rank: the manifests to rank 0, which checks and publishes (or, jointly,
    the groups' publisher), and the outcome to every rank."""
    items, plain, holdings, world = save._what
    path, tmp, joint, rank = save.path, save.tmp, save.joint, rank_world()[0]
    call = f"save_checkpoint({path!r})"
    manifests = _gather_manifests({"pieces": save.pieces, "error": save.error,
                                   "expected": save.expected, **save.rules,
                                   **({"resume": save.resume} if joint is not None else {})},
                                  tmp,
                                  joint.file_rank() if joint is not None else rank, call)
    errors: list[str] = []
    if joint is not None and rank != 0:  # the group's leader decides; wait in the store
        outcome = joint.outcome()
        errors = [outcome] if outcome else []
    elif manifests is None:  # not rank 0 (the manifests reach rank 0 only): it learns
        pass                 # the outcome below
    elif joint is not None:
        errors = _publish_jointly(joint, path, tmp, items, manifests, plain, holdings)
    else:  # rank 0
        errors = [r["error"] for r in manifests if r["error"]]
        if not errors:
            try:
                _publish(path, tmp, items, manifests, plain, world, holdings)
            except Exception as e:
                errors.append(f"rank 0: {type(e).__name__}: {e}")
        if errors:  # before the others learn the outcome: they return to a clean dir
            shutil.rmtree(tmp, ignore_errors=True)
    # rank 0 decides; a refusal every rank made is said once
    outcome = broadcast_json("; ".join(dict.fromkeys(errors)) if rank == 0 else None, call)
    if outcome:
        raise CheckpointError(f"save_checkpoint({path!r}) failed; the previous checkpoint "
                              f"(if any) is unchanged. {outcome}")


def _guarded(check: Callable[..., str | None], *args: Any) -> str | None:
    """``check(*args)``'s refusal, or what it raised as one: rank 0 runs it alone while
    the others wait in the broadcast that carries its answer."""
    try:
        return check(*args)
    except Exception as e:  # noqa: BLE001 - any error is the save's refusal
        return f"rank 0: {type(e).__name__}: {e}"


def _stage(writes: Iterable[Write[Item]]) -> list[tuple[Write[Item], np.ndarray]]:
    """``(write, its rows as a host array)`` for each write: each item read once."""
    arrays, staged = {}, []
    for w in writes:
        it = w.item
        if id(it) not in arrays:
            arrays[id(it)] = np.ascontiguousarray(it.get()).reshape(it.size)
        rows = arrays[id(it)]
        # a chunk is copied out, so the item's whole copy goes once staged
        staged.append((w, rows if w.whole else rows[w.lo:w.hi].copy()))
    return staged


def _joint_save(holdings: Holdings) -> JointSaver | None:
    """The live replica groups' :class:`paddle_hsdp.ft.joint_save.JointSave` when the
    model trains in a fault-tolerant job (its outer group carries one), else None."""
    for buf in holdings.buffers:
        # (comm's GroupTraits types joint_save as object, knowing nothing of
        # checkpoint; the one declaration, ft's Replica, declares a JointSave)
        return cast("JointSaver | None", traits_of(buf.outer_group).joint_save)
    return None


def _publish_jointly(joint: JointSaver, path: str, tmp: str, items: list[Item],
                     manifests: list[dict], plain: dict, holdings: Holdings) -> list[str]:
    """A replica group's leader: hand this group's manifests to the others; the group
    that completes the set checks that every group's pieces tile every tensor and
    publishes, the others learn its outcome. Returns the save's errors (none:
    published)."""
    try:
        commit = _commit_group(tmp, joint.file_rank(), {
            "manifests": manifests, "errors": [r["error"] for r in manifests if r["error"]]})
        groups = joint.gather(commit)
        if groups is None:
            outcome = joint.outcome()
            return [outcome] if outcome else []
        every, errors = _read_groups(tmp, groups)
        if not errors:
            resume, why = resume_of(every)
            plain = dict(plain, ft=resume)
            errors += [why] if why else []
        if not errors:
            try:
                _publish(path, tmp, items, every, plain, joint.world_size, holdings)
            except Exception as e:
                errors.append(f"the publishing group: {type(e).__name__}: {e}")
        if errors:
            shutil.rmtree(tmp, ignore_errors=True)
        joint.announce("; ".join(dict.fromkeys(errors)))
        return errors
    except Exception as e:  # the coordinator's store failed us: the save failed
        return [f"the replica groups' save: {type(e).__name__}: {e}"]

MANIFESTS = ".manifests"  # the ranks' and groups' manifests in a save's temporary folder


def _manifest_path(tmp: str, name: str) -> str:
    return os.path.join(tmp, MANIFESTS, name)


def _write_manifest(tmp: str, name: str, data: bytes) -> None:
    os.makedirs(os.path.join(tmp, MANIFESTS), exist_ok=True)
    with open(_manifest_path(tmp, name), "wb") as f:
        f.write(data)


def _gather_manifests(record: dict, tmp: str, file_rank: int, what: str) -> list[dict] | None:
    """Every rank's manifest on rank 0, in rank order; None on the others, which receive
    nothing. No rank sends more than its own bytes: each rank but rank 0 writes its
    manifest's JSON into ``tmp/.manifests/rank-<file rank>.json`` (the folder every rank
    writes its data into), then one fixed-size gather brings rank 0 each rank's
    ``(file rank, length, CRC-32)``, 24 bytes a rank, and rank 0 reads exactly each
    rank's bytes. A rank whose file could not be written, or reads back other than it
    said, gives rank 0 an error naming it (the save fails; the previous checkpoint
    stays). The folder goes before the checkpoint is published (:func:`_publish`)."""
    rank, world = rank_world()
    data = json.dumps(record).encode()
    if world == 1:
        return [json.loads(data)]
    size, crc = len(data), zlib.crc32(data)
    if rank != 0:
        try:
            _write_manifest(tmp, f"rank-{file_rank:05d}.json", data)
        except OSError as e:  # rank 0 names it: -1 and the errno
            size, crc = -1, e.errno or 0
    heads = gather_sizes_to_root([file_rank, size, crc], f"{what}: the ranks' manifest sizes")
    if heads is None:
        return None
    out: list[dict] = []
    for r, (name, n, check) in enumerate(heads):
        if r == 0:
            out.append(json.loads(data))
            continue
        where = _manifest_path(tmp, f"rank-{name:05d}.json")
        if n < 0:
            out.append({"pieces": [], "error": f"rank {r}: could not write its manifest "
                        f"{where}: {os.strerror(check) if check else 'unknown error'}"})
            continue
        try:
            with open(where, "rb") as f:
                got = f.read(n + 1)
        except OSError as e:
            got, why = b"", f"{type(e).__name__}: {e}"
        else:
            why = "" if len(got) == n and zlib.crc32(got) == check else (
                f"it holds {len(got)} bytes (CRC-32 {zlib.crc32(got):08x}) where the rank "
                f"wrote {n} (CRC-32 {check:08x})")
        out.append(json.loads(got) if not why else
                   {"pieces": [], "error": f"rank {r}: its manifest {where}: {why}"})
    return out


def _commit_group(tmp: str, file_rank: int, payload: dict) -> dict:
    """A replica group's leader in a joint save: its ranks' manifests (``payload``) into
    one file of the shared temporary folder, and the small commit record that goes to
    the job's shared data instead of them (a file name, its bytes and SHA-256: under
    200 bytes, whatever the model; the manifests of a 70B model are megabytes, and
    etcd refuses a value over 1.5 MiB)."""
    data = json.dumps(payload).encode()
    name = f"group-{file_rank:05d}.json"
    try:
        _write_manifest(tmp, name, data)
    except OSError as e:
        return {"error": f"rank {file_rank}: could not write its group's manifests "
                         f"{_manifest_path(tmp, name)}: {type(e).__name__}: {e}"[:1000]}
    return {"file": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _read_groups(tmp: str, commits: list[dict]) -> tuple[list[dict], list[str]]:
    """The publishing group: every group's manifests, read from the files its commit
    record names and checked against the record's length and SHA-256; and the save's
    errors (the groups' own, and a file that is missing or differs, named)."""
    manifests: list[dict] = []
    errors: list[str] = []
    for commit in commits:
        if "error" in commit:
            errors.append(str(commit["error"]))
            continue
        name = str(commit.get("file", ""))
        if not (name.startswith("group-") and name.endswith(".json")
                and name[6:-5].isdigit()):
            errors.append(f"a replica group's commit record names no manifest file of a "
                          f"save ({name!r})")
            continue
        where = _manifest_path(tmp, name)
        try:
            with open(where, "rb") as f:
                data = f.read(int(commit["bytes"]) + 1)
        except (OSError, ValueError, KeyError) as e:
            errors.append(f"the group manifests {where}: {type(e).__name__}: {e}")
            continue
        if len(data) != commit["bytes"] or \
                hashlib.sha256(data).hexdigest() != commit.get("sha256"):
            errors.append(f"the group manifests {where} differ from the group's commit "
                          f"record ({len(data)} bytes where it says {commit['bytes']}, or "
                          "another SHA-256)")
            continue
        payload = json.loads(data)
        manifests += payload["manifests"]
        errors += payload["errors"]
    return manifests, errors


def resume_of(manifests: list[dict]) -> tuple[dict | None, str | None]:
    """A joint save's resume state (the metadata's ``ft``): ``{"step", "ranks"}``, one
    entry per rank of the group that wrote the replicated boxes (each its step, RNG,
    scheduler and user state), from the ranks' manifests; and why it is unusable, or
    None. ``(None, None)`` when no rank gave one (a saver without a resume state)."""
    states = sorted((m["resume"] for m in manifests if m.get("resume")),
                    key=lambda state: state["rank"])
    if not states:
        return None, None
    if [s["rank"] for s in states] != list(range(len(states))) or \
            len({s["step"] for s in states}) != 1:
        return None, ("the writing group's resume states disagree (ranks "
                      f"{[s['rank'] for s in states]}, steps {sorted({s['step'] for s in states})})")
    return {"step": states[0]["step"], "ranks": states}, None


def _refusal_to_tile(tensors: dict, tags: dict, rules: dict | None = None) -> str | None:
    """Why the pieces of ``tensors`` (the metadata's, before it is written) do not tile
    every tensor exactly once, or None. ``tags``: name -> the writers' tags of its
    pieces (local experts of different EP ranks under one name differ). A ruled
    tensor counts each rule's box (its buffer's rows tile it by the layout's
    construction)."""
    rules = {} if rules is None else rules
    for name in sorted(tensors):
        entry = tensors[name]
        boxes = [(tuple(p["offset"]), tuple(p["shape"])) for p in entry["pieces"]]
        boxes += [slice_box(rules[r], name) for r in entry.get("rules", ())]
        why = tiling_error(entry["shape"], boxes)
        if why is None:
            continue
        hint = ""
        if len(tags.get(name, ())) > 1:
            hint = (" These are local experts of different EP ranks under one name: give "
                    "them their global indices: mark_expert_params(layer, global_indices=...)")
        return f"{name}: the ranks' pieces do not tile it: {why}.{hint}"
    return None


def _write_pieces(tmp: str, rank: int,
                  staged: Iterable[tuple[Write[Item], np.ndarray]]) -> list:
    """Write this rank's ``staged`` writes (:func:`_stage`) into one file of ``tmp``
    (the few numbers of an inline write go into its manifest entry; a ruled write's
    CRCs into the file's header); return the entries."""
    os.makedirs(tmp, exist_ok=True)
    fname = f"rank-{rank:05d}.safetensors"
    pieces, tensors, header = [], {}, {}
    for w, array in staged:
        it = w.item
        array = np.ascontiguousarray(array)
        piece = {"offset": w.offset, "shape": w.shape, "name": it.name,
                 "full_shape": it.shape, "dtype": it.dtype, "split": it.split,
                 "stage": it.stage, "tag": it.tag}
        if w.inline:
            piece.update(value=array.reshape(-1).tolist(), value_dtype=str(array.dtype))
            pieces.append(piece)
            continue
        key = it.name if w.whole else f"{it.name}@{w.lo}"  # (a ruled write is whole)
        tensors[key] = array
        chunk = chunk_rows(array)
        crcs = [zlib.crc32(array[i:i + chunk].tobytes())
                for i in range(0, int(array.shape[0]), chunk)]
        if it.spot is not None:  # indexed by rule: CRCs in the header, no manifest entry
            name, value = crc_header(key, chunk, crcs)
            header[name] = value
            continue
        piece.update(file=fname, key=key, chunk_rows=chunk, crc32=crcs)
        pieces.append(piece)
    if tensors:
        _write_rank_file(os.path.join(tmp, fname), tensors, header)
    return pieces


def ruled_writes(ruled: Iterable[Item]) -> list[Write[Item]]:
    """The ruled items this rank writes: all its own rows, but of a tensor tensor
    parallelism does not split, the mp copies hold the same rows: mp rank 0 writes."""
    return [Write(it, 0, it.size[0]) for it in ruled
            if it.replicas.index == 0 and not it.empty]


def describe_rules(ruled: Iterable[Item], stage: int, rank: int) -> dict:
    """What this rank sends rank 0 of its ruled items: its place in each ruled buffer's
    FSDP group and, on the group's first rank (inner 0, outer part 0), each buffer's
    rule; nothing without ruled items."""
    by_buffer: dict[int, list] = {}
    for it in ruled:
        if it.spot is None:
            raise ValueError(f"describe_rules: {it.name} has no spot; only ruled items "
                             "(their spot set) are described")
        by_buffer.setdefault(id(it.spot.buffer), []).append(it)
    rules, places, gids = {}, [], {}
    for group in by_buffer.values():
        buf = group[0].spot.buffer
        fsdp = buf.fsdp_group
        if id(fsdp) not in gids:  # (named from its members once, not once per buffer)
            gids[id(fsdp)] = group_id(buf, list(fsdp.ranks))
        gid = gids[id(fsdp)]
        place = place_of(buf, rank, gid)
        if place not in places:
            places.append(place)
        if place[1:3] != [0, 0]:
            continue
        tensors = {it.name: [it.spot.index, list(it.spot.base), it.size[1:], it.shape,
                             it.dtype, it.split]
                   for it in group if it.replicas.index == 0}
        rules[f"{gid}/{buf.unit}.{buf.index}"] = rule_of(buf, gid, stage, tensors)
    return {"rules": rules, "places": places} if places else {}


def _refusal_to_replace(path: str) -> str | None:
    """Why ``path`` must not be replaced, or None. Only a paddle_hsdp checkpoint (its
    metadata says so) is replaced: anything else there is the user's and stays."""
    if not os.path.lexists(path):
        return None
    if not os.path.isdir(path):
        return (f"{path} exists and is not a directory; save_checkpoint replaces only a "
                f"{FORMAT} checkpoint directory. Choose another path or remove it.")
    try:
        read_metadata(path)
        return None  # one of ours: replaced when the new one is in place
    except (CheckpointError, AttributeError):  # AttributeError: metadata JSON not a dict
        pass
    entries = sorted(os.listdir(path))
    if not entries:
        return None  # an empty directory holds nothing to lose
    shown = ", ".join(entries[:5]) + (f", ... ({len(entries)} entries)" if len(entries) > 5 else "")
    return (f"{path} exists and is not a {FORMAT} checkpoint (it holds {shown}); "
            "save_checkpoint replaces only its own checkpoints, so nothing was written. "
            "Choose another path or remove it.")


def _publish(path: str, tmp: str, items: list[Item], manifests: list[dict], plain: dict,
             world: int, holdings: Holdings) -> None:
    tensors = {it.name: _entry(it.shape, it.dtype, it.split) for it in items}
    rules, groups, stages = index_manifests(tensors, manifests)
    if holdings.pp_degree > 1:
        for name, t in tensors.items():
            t["stages"] = sorted(stages.get(name, ()))
    meta = {"format": FORMAT, "world_size": world, "layout": dict(holdings.job_layout),
            "tensors": tensors, "rules": rules, "rank_groups": groups,
            "aliases": dict(holdings.aliases),
            "lr_scheduler": plain["lr_scheduler"], "extra": plain["extra"],
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if plain.get("ft") is not None:  # a fault-tolerant job's joint save: what resumes it
        meta["ft"] = plain["ft"]
    meta_path = os.path.join(tmp, META)
    os.makedirs(tmp, exist_ok=True)
    shutil.rmtree(os.path.join(tmp, MANIFESTS), ignore_errors=True)  # read: not published
    with open(meta_path, "w") as f:
        json.dump(meta, f, separators=(",", ":"), default=float)  # C encoder: compact
        f.flush()
        os.fsync(f.fileno())
    if os.path.exists(path):
        os.rename(path, f"{path}.old-{os.path.basename(tmp).rsplit('-', 1)[-1]}")
    os.rename(tmp, path)
    # the replaced checkpoint, and what an earlier save left when a rank died mid-write
    for stale in glob.glob(glob.escape(path) + ".tmp-*") + glob.glob(glob.escape(path) + ".old-*"):
        shutil.rmtree(stale, ignore_errors=True)


def index_manifests(tensors: dict, manifests: list) -> tuple[dict, dict, dict]:
    """Rank 0's index: every rank's manifest (its pieces; the rules it leads) into
    ``tensors`` (name -> entry), checked: every box some rank is first holder of was
    written, and every tensor is tiled exactly once. Returns ``(rules, rank groups,
    name -> stages)``; raises ``CheckpointError``. Pure: tools/sim_checkpoint.py runs
    it on a simulated job's manifests."""
    stages: dict[str, set[int]] = {}
    tags: dict[str, set[str]] = {}
    seen: set[tuple] = set()
    for record in manifests:  # other ranks hold tensors rank 0 has not (experts, stages)
        for piece in record["pieces"]:
            name, shape, dtype = piece.pop("name"), piece.pop("full_shape"), piece.pop("dtype")
            split, stage, tag = piece.pop("split"), piece.pop("stage"), piece.pop("tag")
            entry = _entry_of(tensors, name, shape, dtype, split)
            stages.setdefault(name, set()).add(stage)
            tags.setdefault(name, set()).add(tag)
            box = (name, tuple(piece["offset"]), tuple(piece["shape"]), tag)
            if box in seen:  # the same box from two holders (a layer tied across stages)
                continue
            seen.add(box)
            entry["pieces"].append(piece)
    rules: dict[str, dict] = {}
    ruled: set[tuple[str, tuple[tuple, tuple]]] = set()
    for record in manifests:  # HFSDP's optimizer rows, by rule (checkpoint/rules.py)
        for rule_id, rule in record.get("rules", {}).items():
            rules[rule_id] = rule
            for name, (_, _, _, shape, dtype, split) in rule["tensors"].items():
                entry = _entry_of(tensors, name, shape, dtype, split)
                stages.setdefault(name, set()).add(rule["stage"])
                ruled_box = (name, slice_box(rule, name))
                if ruled_box not in ruled:  # a layer tied across stages: its first rule only
                    ruled.add(ruled_box)
                    entry.setdefault("rules", []).append(rule_id)
    try:
        groups = grids([p for record in manifests for p in record.get("places", ())], rules)
    except ValueError as e:
        raise CheckpointError(f"the ranks' places in their FSDP groups: {e}") from None
    unwritten = sorted({n for r in manifests for n in r.get("expected", ())} - set(tensors))
    if unwritten:
        raise CheckpointError(f"{unwritten[0]} (and {len(unwritten) - 1} more): held, yet "
                              "no rank wrote it (the holders' plans disagreed)")
    refusal = _refusal_to_tile(tensors, tags, rules)
    if refusal is not None:
        raise CheckpointError(refusal)
    for t in tensors.values():
        t["pieces"].sort(key=lambda p: p["offset"])
        if "rules" in t:
            t["rules"].sort()
    return rules, groups, stages


def _entry_of(tensors: dict, name: str, shape: list[int], dtype: str,
              split: dict | None) -> dict:
    """``tensors[name]`` (made if new), refusing ranks that disagree on its shape."""
    entry = tensors.setdefault(name, _entry(shape, dtype, split))
    if [entry["shape"], entry["dtype"]] != [shape, dtype]:
        raise CheckpointError(f"{name}: ranks disagree on its full shape or dtype "
                              f"({entry['shape']} {entry['dtype']} vs {shape} {dtype})")
    return entry


def _entry(shape: list[int], dtype: str, split: dict | None) -> dict:
    entry: dict[str, Any] = {"shape": shape, "dtype": dtype, "pieces": []}
    if split is not None:
        entry["split"] = split
    return entry
