"""Checkpoints in one process (no distributed init; the one-rank fake mesh for a
sharded model): the format, the plain-model round trip, refusals and the CLI.
Cross-layout resumes are in test_collective/test_checkpoint.py."""

import dataclasses
import json
import os

import numpy as np
import paddle
import pytest

import paddle_hsdp
from paddle_hsdp import checkpoint
from paddle_hsdp.checkpoint.format import Reader
from paddle_hsdp.engine.holdings import layout_of
from kit import batch_ids, models, shard_tinylm


def _train_step(model, opt):
    models.lm_loss(model, batch_ids(), True).backward()
    opt.step()
    opt.clear_grad()


def test_a_directory_that_is_not_a_checkpoint_is_never_replaced(tmp_path, registry):  # noqa: F811
    """Only a paddle_hsdp checkpoint is replaced: a directory of anything else (or a
    file) is refused before any file is written, naming it and what it holds, and
    stays byte for byte; an empty directory and an older checkpoint are replaced."""
    model = models.build_model()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("x")
    (tmp_path / "afile").write_text("y")
    for target, says in ((mine, "notes.txt"), (tmp_path / "afile", "not a directory")):
        with pytest.raises(checkpoint.CheckpointError, match="save_checkpoint") as err:
            checkpoint.save_checkpoint(target, model)
        assert str(target) in str(err.value) and says in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "mine"]  # no tmp dirs
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    assert (mine / "notes.txt").read_text() == "x" and (tmp_path / "afile").read_text() == "y"
    (tmp_path / "empty").mkdir()
    checkpoint.save_checkpoint(tmp_path / "empty", model)
    checkpoint.save_checkpoint(tmp_path / "empty", model)  # an older checkpoint: replaced
    assert checkpoint.read_metadata(tmp_path / "empty")["format"]


def test_a_save_sweeps_what_an_interrupted_save_left(tmp_path, registry):  # noqa: F811
    """A rank that died mid-save leaves CKPT.tmp-<token> (and a crash mid-rename
    CKPT.old-<token>); the next successful save of CKPT removes them."""
    model = models.build_model()
    for leftover in ("ck.tmp-123", "ck.old-456"):
        (tmp_path / leftover).mkdir()
        (tmp_path / leftover / "rank-00000.safetensors").write_bytes(b"partial")
    checkpoint.save_checkpoint(tmp_path / "ck", model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_plain_model_round_trip_with_optimizer_state(tmp_path, registry):  # noqa: F811
    model = models.build_model()
    opt = models.make_optimizer(model, model.parameters(), 0.2)
    _train_step(model, opt)
    checkpoint.save_checkpoint(tmp_path / "ck", model, opt, extra={"step": 1, "seed": 7})
    meta = checkpoint.read_metadata(tmp_path / "ck")
    assert meta["aliases"] == {"head.weight": "embed.weight"}
    assert "embed.weight/optim/moment1" in meta["tensors"]
    other = models.build_model(seed=3)
    other_opt = models.make_optimizer(other, other.parameters(), 0.2)
    assert checkpoint.load_checkpoint(tmp_path / "ck", other, other_opt) == {"step": 1, "seed": 7}
    for (n, a), b in zip(model.named_parameters(), other.parameters()):
        assert np.array_equal(a.numpy(), b.numpy()), n
    _train_step(model, opt)  # the moments and beta powers came along: same next step
    _train_step(other, other_opt)
    for (n, a), b in zip(model.named_parameters(), other.parameters()):
        assert np.array_equal(a.numpy(), b.numpy()), n


def test_an_async_save_holds_the_step_it_was_called_at(tmp_path, registry):  # noqa: F811
    """The files are written by a thread while training goes on; the next load waits
    for the save to be published. A bad ``async_save`` is refused before anything."""
    model = models.build_model()
    opt = models.make_optimizer(model, model.parameters(), 0.2)
    _train_step(model, opt)
    want = {n: p.numpy().copy() for n, p in model.named_parameters()}
    with pytest.raises(TypeError, match="async_save must be True or False, got 'yes'"):
        checkpoint.save_checkpoint(tmp_path / "ck", model, opt, async_save="yes")
    sched = paddle.optimizer.lr.StepDecay(0.1, step_size=1, gamma=0.5)
    opt._learning_rate = sched  # the scheduler the metadata records
    extra = {"step": 1}
    handle = checkpoint.save_checkpoint(tmp_path / "ck", model, opt, extra=extra,
                                        async_save=True)
    _train_step(model, opt)  # changes every parameter while the save is in flight
    sched.step()
    extra["step"] = 2  # (found in review: both were read at publish time)
    other = models.build_model(seed=3)
    assert checkpoint.load_checkpoint(tmp_path / "ck", other) == {"step": 1}  # waits
    assert handle.done()
    assert checkpoint.read_metadata(tmp_path / "ck")["lr_scheduler"]["last_epoch"] == 0
    for n, p in other.named_parameters():
        assert np.array_equal(p.numpy(), want[n]), n


def test_sharded_model_loads_into_plain(tmp_path, fake_mesh):  # noqa: F811
    sharded = shard_tinylm(models.build_model())
    opt = models.make_optimizer(sharded, sharded.parameters(), 0.2)
    _train_step(sharded, opt)
    checkpoint.save_checkpoint(tmp_path / "ck", sharded, opt)
    plain = models.build_model(seed=3)
    checkpoint.load_checkpoint(tmp_path / "ck", plain)
    full = paddle_hsdp.full_state_dict(sharded)
    for name, p in plain.named_parameters():
        assert np.array_equal(p.numpy(), full[name].numpy()), name


def test_refusals_change_nothing(tmp_path, registry):  # noqa: F811
    model = models.build_model()
    checkpoint.save_checkpoint(tmp_path / "ck", model)
    other = paddle.nn.Linear(3, 3)
    before = other.weight.numpy().copy()
    with pytest.raises(checkpoint.CheckpointError, match="does not match this model"):
        checkpoint.load_checkpoint(tmp_path / "ck", other)
    assert np.array_equal(other.weight.numpy(), before)
    with pytest.raises(checkpoint.CheckpointError, match="not a checkpoint"):
        checkpoint.load_checkpoint(tmp_path / "nothing", model)
    meta_path = tmp_path / "ck" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["tensors"]["embed.weight"]["shape"] = [1, 1]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(checkpoint.CheckpointError, match="shape"):
        checkpoint.load_checkpoint(tmp_path / "ck", models.build_model())
    with pytest.raises(TypeError):
        checkpoint.save_checkpoint(tmp_path / "ck2", model, extra={"x": object()})
    assert not (tmp_path / "ck2").exists()


def test_cli_inspect_and_consolidate(tmp_path, registry, capsys):  # noqa: F811
    model = models.build_model()
    checkpoint.save_checkpoint(tmp_path / "ck", model, extra={"step": 4})
    assert checkpoint.main(["inspect", str(tmp_path / "ck")]) == 0
    text = capsys.readouterr().out
    assert "embed.weight" in text and "head.weight" in text and '"step": 4' in text
    assert checkpoint.main(["consolidate", str(tmp_path / "ck"), str(tmp_path / "f.st")]) == 0
    from safetensors.numpy import load_file

    assert sorted(load_file(str(tmp_path / "f.st"))) == sorted(model.state_dict())
    assert checkpoint.main(["inspect", str(tmp_path / "missing")]) == 1
    assert "error: " in capsys.readouterr().out


def test_the_consolidated_file_cannot_pass_for_a_from_pretrained_checkpoint(
        tmp_path, registry, capsys):  # noqa: F811
    """Paddle layout: its metadata says so and what loads it, and the names a
    from_pretrained directory picks up are refused before anything is written."""
    model = models.build_model()
    checkpoint.save_checkpoint(tmp_path / "ck", model)
    from safetensors import safe_open

    checkpoint.consolidate(tmp_path / "ck", tmp_path / "full.paddle.safetensors")
    with safe_open(str(tmp_path / "full.paddle.safetensors"), "np") as f:
        meta = f.metadata()
    assert meta["format"] == "paddle_hsdp-consolidated" and meta["layout"] == "paddle"
    assert "export_pretrained" in meta["not_for"]
    for name in ("model.safetensors", "model-00001-of-00002.safetensors"):
        assert checkpoint.main(["consolidate", str(tmp_path / "ck"),
                                str(tmp_path / "hf" / name)]) == 1
        out = capsys.readouterr().out
        assert "from_pretrained loads as Hugging Face layout" in out and "export_pretrained" in out
        assert not (tmp_path / "hf").exists()


class _Experts(paddle.nn.Layer):
    def __init__(self, n):
        super().__init__()
        self.experts = paddle.nn.LayerList([paddle.nn.Linear(3, 3) for _ in range(n)])


def test_global_expert_indices_name_local_experts_in_checkpoints(tmp_path):
    model = _Experts(2)  # this rank's experts are the global experts 4 and 6
    paddle_hsdp.mark_expert_params(model.experts, global_indices=[4, 6])
    checkpoint.save_checkpoint(tmp_path / "ck", model)
    names = sorted(checkpoint.read_metadata(tmp_path / "ck")["tensors"])
    assert names == ["experts.4.bias", "experts.4.weight", "experts.6.bias", "experts.6.weight"]
    assert all(getattr(p, "is_moe_param", False) for p in model.parameters())


@pytest.mark.parametrize("indices,exc,match", [
    ([0], ValueError, "one global index per local expert"),
    ([1, 1], ValueError, "distinct non-negative"),
    ([0, -1], ValueError, "distinct non-negative"),
    (["a", 1], TypeError, "sequence of non-negative ints"),
])
def test_global_expert_indices_refused_before_marking(indices, exc, match):
    model = _Experts(2)
    with pytest.raises(exc, match=match):
        paddle_hsdp.mark_expert_params(model.experts, global_indices=indices)
    assert not any(getattr(p, "is_moe_param", False) for p in model.parameters())


def test_optimizer_sharded_state_dict_keeps_paddles_form_for_plain_optimizers():
    model = models.build_model()
    opt = models.make_optimizer(model, model.parameters(), 0.2)
    _train_step(model, opt)
    osd = opt.sharded_state_dict(model.sharded_state_dict())
    assert "blocks.0.fc1.weight.moment1_0" in osd and "embed.weight.beta1_pow_acc_0" in osd
    assert osd["blocks.0.fc1.weight.moment1_0"].global_shape == (8, 25)


def test_bfloat16_round_trip_and_export(tmp_path):
    paddle.seed(1)
    net = paddle.nn.Linear(3, 5)
    net.to(dtype="bfloat16")
    checkpoint.save_checkpoint(tmp_path / "ck", net)
    assert checkpoint.read_metadata(tmp_path / "ck")["tensors"]["weight"]["dtype"] == "bfloat16"
    paddle.seed(2)
    other = paddle.nn.Linear(3, 5)
    other.to(dtype="bfloat16")
    checkpoint.load_checkpoint(tmp_path / "ck", other)
    assert other.weight.dtype == paddle.bfloat16
    assert np.array_equal(other.weight.numpy(), net.weight.numpy())
    checkpoint.consolidate(tmp_path / "ck", tmp_path / "full.safetensors")
    raw = (tmp_path / "full.safetensors").read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert header["weight"]["dtype"] == "BF16" and header["weight"]["shape"] == [3, 5]
    start, end = header["weight"]["data_offsets"]
    body = raw[8 + int.from_bytes(raw[:8], "little"):]
    assert body[start:end] == net.weight.numpy().tobytes()


def test_a_load_reads_and_checks_only_the_chunks_it_needs(tmp_path):
    """Each piece carries a CRC per ~4 MiB of rows: reading some rows touches only the
    chunks that cover them, and a corrupted byte is found by whoever reads its chunk."""
    net = paddle.nn.Linear(512, 4096)  # weight [512, 4096] float32: 16 KiB rows, 8 MiB
    checkpoint.save_checkpoint(tmp_path / "ck", net)
    meta = checkpoint.read_metadata(tmp_path / "ck")
    piece = meta["tensors"]["weight"]["pieces"][0]
    assert piece["chunk_rows"] == 256 and len(piece["crc32"]) == 2
    raw = bytearray((tmp_path / "ck" / piece["file"]).read_bytes())
    header = 8 + int.from_bytes(raw[:8], "little")
    start = json.loads(raw[8:header])["weight"]["data_offsets"][0]
    raw[header + start + 400 * 4096 * 4] ^= 0xFF  # a byte of row 400: the second chunk
    (tmp_path / "ck" / piece["file"]).write_bytes(bytes(raw))
    reader = Reader(str(tmp_path / "ck"))
    rows = reader.rows("weight", piece, 10, 20)
    assert np.array_equal(rows, net.weight.numpy()[10:20])
    with pytest.raises(checkpoint.CheckpointError, match="CRC mismatch in rows 256"):
        reader.rows("weight", piece, 250, 260)


def test_rank_0_reads_each_ranks_manifest_from_its_file_and_names_a_bad_one(
        tmp_path, monkeypatch):
    """Issue 62 (item 5): the manifests' gather padded every rank's message to the
    longest (1.0 GB on rank 0 at W = 8,192 for 26 MB of content). Now each rank writes
    its manifest into the save's temporary folder and rank 0 gathers only (file rank,
    length, CRC-32), then reads exactly each rank's bytes; a file that is missing,
    short or altered is the save's error, naming the rank. (Three ranks played in one
    process: the gather of the heads is faked.)"""
    from paddle_hsdp.checkpoint import save
    tmp = str(tmp_path / "ckpt.tmp-1")
    records = [{"pieces": [{"r": r}], "error": None} for r in range(4)]
    heads = []

    def play(rank, record, file_rank):  # one rank's call, its head kept for rank 0
        monkeypatch.setattr(save, "rank_world", lambda: (rank, 4))
        monkeypatch.setattr(save, "gather_sizes_to_root",  # rank order: rank 0 first
                            lambda values, what: [values] + heads if rank == 0
                            else heads.append(values))
        return save._gather_manifests(record, tmp, file_rank, "test")
    for r in (1, 2, 3):
        assert play(r, records[r], 10 + r) is None
    written = sorted(os.listdir(os.path.join(tmp, save.MANIFESTS)))
    assert written == ["rank-00011.json", "rank-00012.json", "rank-00013.json"]
    with open(os.path.join(tmp, save.MANIFESTS, "rank-00012.json"), "a") as f:
        f.write(" ")  # rank 2's file is not what it said it wrote
    got = play(0, records[0], 10)
    assert got[0] == records[0] and got[1] == records[1] and got[3] == records[3]
    assert got[2]["error"].startswith("rank 2: its manifest") and "rank-00012.json" in \
        got[2]["error"] and "where the rank wrote" in got[2]["error"]


def test_layout_of_states_every_tensor_once_and_reads_its_values(fake_mesh):  # noqa: F811
    """engine/holdings.py's ``layout_of``, all the checkpoint reads of the engine: every
    tensor of a sharded TinyLM once under its saved name (the tied head an alias), its
    full shape and the box this one rank holds (all of it), each AdamW state of each
    trainable parameter; ``read()`` gives what ``full_state_dict`` gives; it cannot be
    changed."""
    sharded = shard_tinylm(models.build_model())
    opt = models.make_optimizer(sharded, sharded.parameters(), 0.2)
    _train_step(sharded, opt)
    held = layout_of(sharded, opt)
    full = paddle_hsdp.full_state_dict(sharded)
    assert held.aliases == {"head.weight": "embed.weight"}
    params = [t for t in held.tensors if t.state is None]
    assert sorted(t.name for t in params) == sorted(set(full) - set(held.aliases))
    for t in params:
        assert t.full_shape == tuple(full[t.name].shape) == t.size, t
        assert t.offset == (0,) * len(t.size) and t.buffer is not None, t
        assert np.array_equal(t.read(), full[t.name].numpy()), t.name
    states = {}
    for t in held.tensors:
        if t.state is not None:
            states.setdefault(t.name, set()).add(t.state)
    assert states == {t.name: {"moment1", "moment2", "beta1_pow_acc", "beta2_pow_acc"}
                      for t in params if t.name != "pos"}, states  # (pos is frozen)
    assert {t.name for t in layout_of(sharded, opt, trainable_only=True).tensors} == \
        set(states)
    assert [b.unit for b in held.buffers] == sorted(b.unit for b in held.buffers)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params[0].name = "renamed"
    with pytest.raises(TypeError):
        held.aliases["pos"] = "embed.weight"
