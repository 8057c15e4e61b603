"""PaddleFormers' ``Trainer`` with HSDP: :class:`HSDPTrainingArguments` and
:class:`HSDPTrainer`.

The arguments run ``fleet.init`` with the HSDP strategy in their ``__post_init__``,
before PaddleFormers would run its own (it skips its own once a parallel context
exists), so the topology is right whichever order a script builds things in. With
``sharding`` empty, PaddleFormers sees plain data parallelism over all ``outer x inner``
ranks, which is what its sampler must see: every rank reads different data.

The trainer shards the model with :func:`paddle_hsdp.apply_config` before the
optimizer is built, adds no ``DataParallel`` wrapper (so none of the Trainer's own
gradient all-reduces runs on shards), and saves and loads checkpoints through
PaddleFormers' flex-checkpoint hooks with :func:`paddle_hsdp.save_checkpoint` /
:func:`paddle_hsdp.load_checkpoint`: written once across replicas, resumable in any
layout and in one process. The Trainer's own files (trainer state, RNG, scheduler,
rotation) stay its own. See docs/paddleformers.md.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import glob
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Optional

import paddle
import paddle.distributed as dist
from paddle.distributed import fleet
from paddle.distributed.fleet.utils.hybrid_parallel_util import broadcast_mp_parameters
from paddleformers.peft import LoRAConfig, LoRAModel
from paddleformers.trainer import Trainer, TrainingArguments
from paddleformers.trainer.trainer_utils import OptimizerNames
from paddleformers.utils.env import LORA_WEIGHTS_NAME

from ..checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ..checkpoint.full_model import full_model
from ..config.apply import (live_hcg, apply_config, init_fleet_if_needed, outer_sharding_of,
                            topology_of)
from ..config.schema import (AUTO, OUTER_SHARDING, ConfigError, HSDPConfig, load_config,
                             ranks_per_node_from_env, resolve_degrees)
from ..engine.api import FSDPModule
from ..optim.muon import MUON_EXCLUDE, Muon, muon_param_info
from ..patches.clip import last_global_norm
from ..topology.placement import is_expert

if TYPE_CHECKING:
    from ..config.plan import Plan

logger = logging.getLogger(__name__)

# Inside each checkpoint-N folder: model and optimizer state, in paddle_hsdp's format.
HSDP_CHECKPOINT_DIR = "hsdp"
_FLEX = "flex_checkpoint"


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class HSDPTrainingArguments(TrainingArguments):
    """``TrainingArguments`` plus HSDP's own; see docs/paddleformers.md for the table."""

    # HSDP is the sharding here: PaddleFormers' own stages stay off (default "stage1").
    sharding: str = field(default="", metadata=_help(
        "PaddleFormers' sharding stages, mapped onto HSDP's: 'stage1' / 'stage2' / "
        "'stage3' set hsdp_config's zero_stage 1 / 2 / 3, 'offload' its offload_to_cpu; "
        "PaddleFormers' own sharding stays off. Default: empty (hsdp_config's)."))
    # HSDP's MixedPrecisionPolicy keeps fp32 shards and reduces in fp32 under --bf16,
    # which is what master grads give; PaddleFormers refuses True without bf16/fp16.
    amp_master_grad: bool = field(default=False, metadata=_help(
        "Under --bf16, grads are reduced and kept in float32 either way (HSDP's "
        "MixedPrecisionPolicy); True is accepted and means the same."))
    fsdp_outer_degree: Optional[str] = field(default=None, metadata=_help(
        "HSDP replicas (the outer degree): an int, or 'auto' for one replica per "
        "machine. Default: hsdp_config's value, else 'auto'."))
    fsdp_outer_sharding: Optional[str] = field(default=None, metadata=_help(
        "'none' (HSDP) or 'optim' (HFSDP: the optimizer state sharded across the "
        "replicas too). Default: hsdp_config's value, else 'none'."))
    hsdp_config: Optional[str] = field(default=None, metadata=_help(
        "A paddle_hsdp config (YAML path, or a dict from Python) in apply_config's "
        "schema; its degrees must agree with fsdp_outer_degree."))
    hsdp_wrap_modules: Optional[str] = field(default=None, metadata=_help(
        "Modules sharded as their own units: comma-separated patterns or class names "
        "(model.layers.{*}, LlamaDecoderLayer), or 'auto': every block of the model's "
        "main stack of repeated layers. Default: hsdp_config's sub_modules_to_wrap, "
        "else 'auto'."))
    hsdp_checkpoint: bool = field(default=True, metadata=_help(
        "Save and resume model and optimizer in paddle_hsdp's format (written once, "
        "resumable in any layout). False: PaddleFormers' flex_checkpoint."))
    hsdp_async_save: bool = field(default=False, metadata=_help(
        "With hsdp_checkpoint: save asynchronously (save_checkpoint(async_save=True)): "
        "training goes on once each rank's state is copied to host memory; the "
        "checkpoint is published at the next save or at exit; until then the folder "
        "has no hsdp/, and a resume from it is refused, naming the newest published "
        "checkpoint (needs save_total_limit unset or >= 2, so rotation keeps one)."))

    def __post_init__(self):
        # Everything below but fleet.init is local and alike on every rank: a refusal
        # is raised everywhere before any collective.
        with _named_for_the_arguments():
            self.hsdp_from_paddleformers = _paddleformers_sharding(self)
            _refuse_what_cannot_work(self)
            self.hsdp_config_resolved = _hsdp_config_of(self)
            world, split = dist.get_world_size(), _model_split(self)
            self.hsdp_degrees = _hsdp_degrees(self.hsdp_config_resolved, world, self)
        # PaddleFormers' own sharding stays off: its keys now live in the HSDP config
        self.sharding, self.sharding_parallel_size = "", -1
        if hasattr(self, "sharding_degree"):
            self.sharding_degree = -1
        if self.hsdp_from_paddleformers:
            logger.info("HSDPTrainingArguments: PaddleFormers' sharding keys mapped onto "
                        "HSDP's %s", ", ".join(f"{k}={v}" for k, v in
                                               self.hsdp_from_paddleformers.items()))
        outer_sharding = outer_sharding_of(self.hsdp_config_resolved)
        ep = _expert_degree(self)
        if world > 1 and split == 1:
            # hsdp_config's fsdp_outer_sharding goes into sharding_configs too
            init_fleet_if_needed(*self.hsdp_degrees, outer_sharding, ep)
        if self.hsdp_checkpoint:
            # the Trainer's flex-checkpoint paths call the hooks HSDPTrainer overrides,
            # on every rank
            self.save_checkpoint_format = self.load_checkpoint_format = _FLEX
        with _muon_as_hsdp_muon(self):
            self._paddleformers_post_init(world, split, outer_sharding, ep)

    def _paddleformers_post_init(self, world: int, split: int, outer_sharding: str,
                                 ep: int) -> None:
        if world > 1 and split > 1 and live_hcg() is None:
            with _data_ranks_as_hsdp(self.hsdp_degrees[0], outer_sharding):
                super().__post_init__()  # PaddleFormers' hybrid strategy, HSDP data axes
        elif ep > 1:
            # PaddleFormers' own expert parallelism is built for its sharding stages
            # (it refuses data parallelism beside it and scales expert grads by 1 / ep);
            # here fleet already runs the expert groups and HSDP reduces expert grads
            # over the expert data-parallel ranks, so it sees plain data parallelism
            self.expert_model_parallel_size = -1
            try:
                super().__post_init__()
            finally:
                self.expert_model_parallel_size = ep
            self.hybrid_parallel_expert_grad_scale = 1.0
        else:
            super().__post_init__()

    @property
    def dataset_rank(self) -> int:
        """The rank's data shard: its place in the HSDP group (every outer x inner rank
        reads other rows; tensor-parallel ranks and stages of one replica the same)."""
        hcg = live_hcg()
        if hcg is None or not self.use_hybrid_parallel:
            return super().dataset_rank
        return hcg.get_sharding_parallel_rank()

    @property
    def dataset_world_size(self) -> int:
        hcg = live_hcg()
        if hcg is None or not self.use_hybrid_parallel:
            return super().dataset_world_size
        return hcg.get_sharding_parallel_world_size()


def _expert_degree(args: HSDPTrainingArguments) -> int:
    return max(getattr(args, "expert_model_parallel_size", 1) or 1, 1)


def _model_split(args: HSDPTrainingArguments) -> int:
    """Ranks one model replica's data is split over: tensor x pipeline degree."""
    return max(args.tensor_model_parallel_size, 1) * max(args.pipeline_model_parallel_size, 1)


def _hsdp_degrees(cfg: HSDPConfig, world: int,
                  args: HSDPTrainingArguments) -> tuple[int, int]:
    """``(outer, inner)`` over the data-parallel ranks (the world over tensor x pipeline
    degree): the live fleet's when it is up (checked against the config), else the
    config's ('auto': one replica per machine, a machine holding ``ranks per node /
    tensor degree`` data-parallel ranks)."""
    split = _model_split(args)
    if world % split:
        raise ConfigError([
            f"tensor_model_parallel_size: {max(args.tensor_model_parallel_size, 1)} x "
            f"pipeline_model_parallel_size: {max(args.pipeline_model_parallel_size, 1)} = "
            f"{split} does not divide the {world} ranks"])
    hcg = live_hcg() if world > 1 else None
    if hcg is not None:
        live = {"tensor_model_parallel_size": hcg.get_model_parallel_world_size(),
                "pipeline_model_parallel_size": hcg.get_pipe_parallel_world_size()}
        if live["tensor_model_parallel_size"] * live["pipeline_model_parallel_size"] != split:
            raise ConfigError([f"tensor / pipeline degrees: fleet.init ran before these "
                               f"arguments with {live}; build HSDPTrainingArguments first "
                               "or pass the same degrees"])
        live_ep = getattr(hcg, "get_expert_parallel_world_size", lambda: 1)() or 1
        if live_ep != _expert_degree(args):
            raise ConfigError([f"expert_model_parallel_size: fleet.init ran before these "
                               f"arguments with ep_degree {live_ep}; build "
                               "HSDPTrainingArguments first or pass the same degree"])
        return _live_topology(cfg)[:2]
    per_node, tp = ranks_per_node_from_env(), max(args.tensor_model_parallel_size, 1)
    if per_node is not None:
        per_node = per_node // tp if per_node % tp == 0 else None
    outer, inner = resolve_degrees(cfg, world // split, per_node)
    ep = _expert_degree(args)
    if ep > 1 and (world // ep) % outer:
        raise ConfigError([f"fsdp_outer_degree: {outer} does not divide the {world // ep} "
                           f"expert data-parallel ranks (world {world} / "
                           f"expert_model_parallel_size {ep}): every expert replica set "
                           "must hold whole outer replicas"])
    return outer, inner


def uses_muon(args: TrainingArguments) -> bool:
    return str(getattr(args.optim, "value", args.optim)) == OptimizerNames.MUON.value


@contextlib.contextmanager
def _muon_as_hsdp_muon(args: HSDPTrainingArguments) -> Iterator[None]:
    """While PaddleFormers' ``__post_init__`` runs: ``optim`` muon hidden, which it
    refuses without its hybrid-parallel sharding (``use_hybrid_parallel``); under HSDP
    ``optim: muon`` is paddle_hsdp.Muon, built by HSDPTrainer.create_optimizer."""
    if not uses_muon(args):
        yield
        return
    args.optim = OptimizerNames.ADAMW.value
    try:
        yield
    finally:
        args.optim = OptimizerNames.MUON


@contextlib.contextmanager
def _data_ranks_as_hsdp(outer: int, outer_sharding: str) -> Iterator[None]:
    """While PaddleFormers' ``__post_init__`` runs: its ``fleet.init`` gets the hybrid
    strategy it built for a tensor- or pipeline-parallel job (mp and pipeline configs
    included) with its data-parallel ranks moved into HSDP's sharding axis (dp 1,
    sharding ``dp x sharding``, ``fsdp_outer_degree``). Its own sharding stages are
    off (``sharding`` is empty here), so nothing else of it changes."""
    original = fleet.init

    def init(*args: Any, **kwargs: Any) -> Any:
        strategy = kwargs.get("strategy")
        if strategy is not None:
            hybrid = strategy.hybrid_configs
            data = max(hybrid["dp_degree"], 1) * max(hybrid["sharding_degree"], 1)
            strategy.hybrid_configs = {
                "dp_degree": 1, "sharding_degree": data,
                "sharding_configs": {"fsdp_outer_degree": outer,
                                     "fsdp_outer_sharding": outer_sharding}}
        return original(*args, **kwargs)

    fleet.init = init
    try:
        yield
    finally:
        fleet.init = original


@contextlib.contextmanager
def _named_for_the_arguments() -> Iterator[None]:
    """Every problem found, one line each, prefixed with the class that found it."""
    try:
        yield
    except ConfigError as e:
        raise ConfigError([f"HSDPTrainingArguments: {line}" for line in e.errors]) from None


# PaddleFormers' sharding options -> HSDP config values (docs/paddleformers.md)
_STAGES = {"stage1": 1, "stage2": 2, "stage3": 3}
_PF_KEY_OF = {"zero_stage": "sharding", "offload_to_cpu": "sharding",
              "sharding_size": "sharding_parallel_size"}


def _paddleformers_sharding(args: HSDPTrainingArguments) -> dict[str, Any]:
    """PaddleFormers' own sharding keys as HSDP config values: ``sharding`` ``stageN``
    -> ``zero_stage`` N, ``offload`` -> ``offload_to_cpu``; ``sharding_parallel_size``
    (or its old name ``sharding_degree``) > 1 -> ``sharding_size`` (the inner degree).
    Local and alike on every rank; anything else is a ConfigError naming the key."""
    value, mapped, errors = args.sharding, {}, []
    if isinstance(value, str):
        options = value.replace(",", " ").split()
    else:  # a list of options, or ShardingOption values
        options = [str(getattr(o, "value", o)) for o in (value or [])]
    allowed = ("allowed: empty, 'stage1', 'stage2' or 'stage3' (HSDP's zero_stage 1-3), "
               "each optionally with 'offload' (HSDP's offload_to_cpu)")
    stages = [o for o in options if o in _STAGES]
    unknown = [o for o in options if o not in _STAGES and o != "offload"]
    if unknown or len(stages) > 1:
        errors.append(f"sharding: {value!r}; {allowed}")
    elif stages:
        mapped["zero_stage"] = _STAGES[stages[0]]
    if "offload" in options and not unknown:
        mapped["offload_to_cpu"] = True
    size = max(getattr(args, "sharding_parallel_size", -1) or -1,
               getattr(args, "sharding_degree", -1) or -1)
    if size > 1:
        mapped["sharding_size"] = size
    if errors:
        raise ConfigError(errors)
    return mapped


def _refuse_what_cannot_work(args: HSDPTrainingArguments) -> None:
    errors = []
    for name in ("sep_parallel_size", "context_parallel_size"):
        if getattr(args, name, -1) > 1:
            errors.append(f"{name}: {getattr(args, name)}; HSDPTrainer does not set up "
                          "sequence-segment or context parallelism yet (tensor, pipeline "
                          "and expert parallelism it does: tensor_model_parallel_size, "
                          "pipeline_model_parallel_size, expert_model_parallel_size); "
                          "allowed: -1 or 1")
    ep = _expert_degree(args)
    if ep > 1 and _model_split(args) > 1:
        errors.append(f"expert_model_parallel_size: {ep} together with tensor or pipeline "
                      "parallelism is not supported by HSDPTrainer yet; allowed with "
                      "tensor_model_parallel_size and pipeline_model_parallel_size 1")
    elif ep > 1 and dist.get_world_size() % ep:
        errors.append(f"expert_model_parallel_size: {ep} does not divide the "
                      f"{dist.get_world_size()} ranks")
    sharding_mode = args.fsdp_outer_sharding
    if sharding_mode is not None and sharding_mode not in OUTER_SHARDING:
        errors.append(f"fsdp_outer_sharding: {sharding_mode!r}; allowed: "
                      f"{', '.join(repr(m) for m in OUTER_SHARDING)}")
    if args.use_expert_parallel:
        errors.append("use_expert_parallel: True switches on PaddleFormers' expert-parallel "
                      "machinery for its own sharding stages (MoEHybridParallelOptimizer, "
                      "no_sync, expert grad scaling); with HSDP set expert_model_parallel_size "
                      "alone (HSDP reduces expert grads over the expert data-parallel ranks)")
    if uses_muon(args):
        errors += _muon_refusals(args)
    if args.fp16:
        errors.append("fp16: not supported by HSDPTrainer (it would need loss scaling over "
                      "shards); use --bf16, which maps to HSDP's MixedPrecisionPolicy")
    if args.to_static:
        errors.append("to_static: HSDP's hooks run in dygraph only; set to_static False")
    outer = args.fsdp_outer_degree
    if outer is not None and str(outer).strip() != AUTO:
        text = str(outer).strip()
        if isinstance(outer, bool) or not text.isdigit() or int(text) < 1:
            errors.append(f"fsdp_outer_degree: {outer!r}; allowed: an int >= 1 or 'auto'")
    if args.hsdp_checkpoint:
        for name in ("save_checkpoint_format", "load_checkpoint_format"):
            value = getattr(args, name)
            if value not in (None, "", _FLEX):
                errors.append(f"{name}: {value!r} conflicts with hsdp_checkpoint=True (HSDP "
                              "checkpoints are written through the flex_checkpoint hooks); "
                              f"leave {name} unset")
        if args.unified_checkpoint:
            errors.append("unified_checkpoint: True conflicts with hsdp_checkpoint=True "
                          "(it saves from rank 0 only, where state_dict() is a collective)")
        limit = getattr(args, "save_total_limit", None)
        if args.hsdp_async_save and limit is not None and limit < 2:
            errors.append(f"save_total_limit: {limit} with hsdp_async_save=True would "
                          "delete the last published checkpoint while the newest is still "
                          "being written; allowed: unset or >= 2")
    else:
        if args.hsdp_async_save:
            errors.append("hsdp_async_save: True needs hsdp_checkpoint=True (flex_checkpoint "
                          "saves synchronously)")
        for name in ("save_checkpoint_format", "load_checkpoint_format"):
            value = getattr(args, name)
            if value != _FLEX:
                errors.append(f"{name}: {value!r} saves or loads on rank 0 only, where "
                              "state_dict() of a sharded model is a collective; allowed "
                              "with hsdp_checkpoint=False: 'flex_checkpoint'")
    if errors:
        raise ConfigError(errors)


def _muon_refusals(args: HSDPTrainingArguments) -> list[str]:
    """``optim: muon`` is paddle_hsdp.Muon, which orthogonalises every weight matrix
    whole: the user says so for the two PaddleFormers keys that ask for parts."""
    errors = []
    if args.muon_qkv_update_mode != "fused_qkv":
        errors.append(f"muon_qkv_update_mode: {args.muon_qkv_update_mode!r}; allowed with "
                      "HSDP's Muon: 'fused_qkv' (each weight matrix orthogonalised whole: "
                      "separate q/k/v projections each as one matrix, a fused one as one); "
                      "per-head or per-projection parts of a fused matrix are not done")
    if args.muon_ffn_split:
        errors.append("muon_ffn_split: True; allowed with HSDP's Muon: False (a fused "
                      "gate_up matrix orthogonalised whole; separate gate and up "
                      "projections are separate matrices either way)")
    return errors


def _hsdp_config_of(args: HSDPTrainingArguments) -> HSDPConfig:
    """The apply_config config the arguments mean: ``hsdp_config`` (or the defaults),
    with ``fsdp_outer_degree`` and ``hsdp_wrap_modules`` filled in or checked."""
    base = load_config(args.hsdp_config if args.hsdp_config is not None else {})
    values = {name: getattr(base, name) for name in base.__dataclass_fields__}
    errors = []
    if args.fsdp_outer_degree is not None:
        given = str(args.fsdp_outer_degree).strip()
        outer: int | str = AUTO if given == AUTO else int(given)
        if args.hsdp_config is not None and base.fsdp_outer_degree not in (AUTO, outer):
            errors.append(f"fsdp_outer_degree: {outer} disagrees with hsdp_config's "
                          f"fsdp_outer_degree {base.fsdp_outer_degree}; set one of them")
        values["fsdp_outer_degree"] = outer
    mode = args.fsdp_outer_sharding
    if mode is not None and mode in OUTER_SHARDING:
        if args.hsdp_config is not None and base.fsdp_outer_sharding not in (AUTO, mode):
            errors.append(f"fsdp_outer_sharding: {mode!r} disagrees with hsdp_config's "
                          f"fsdp_outer_sharding {base.fsdp_outer_sharding!r}; set one of them")
        values["fsdp_outer_sharding"] = mode
    if args.hsdp_wrap_modules is not None:
        wrap = tuple(p.strip() for p in str(args.hsdp_wrap_modules).split(",") if p.strip())
        if base.sub_modules_to_wrap and wrap != base.sub_modules_to_wrap:
            errors.append(f"hsdp_wrap_modules: {args.hsdp_wrap_modules!r} disagrees with "
                          f"hsdp_config's sub_modules_to_wrap {list(base.sub_modules_to_wrap)}; "
                          "set one of them")
        values["sub_modules_to_wrap"] = wrap
    elif not base.sub_modules_to_wrap:
        values["sub_modules_to_wrap"] = (AUTO,)
    for name, want in args.hsdp_from_paddleformers.items():
        if args.hsdp_config is not None and getattr(base, name) not in (None, AUTO, False, want):
            errors.append(f"{_PF_KEY_OF[name]}: means {name} {want!r}, but hsdp_config says "
                          f"{name} {getattr(base, name)!r}; set one of them")
        values[name] = want
    if uses_muon(args):  # each matrix Muon updates whole on one rank (owned_matrices())
        values["owned_matrices"] = True
    if args.bf16:
        for name, want in (("param_dtype", "bf16"), ("reduce_dtype", "fp32")):
            if values[name] not in (None, want):
                errors.append(f"hsdp_config: {name} {values[name]!r} disagrees with --bf16 "
                              f"(which means {name} {want!r}); drop one of them")
            values[name] = want
    if errors:
        raise ConfigError(errors)
    return HSDPConfig(**values)


def _live_topology(cfg: HSDPConfig) -> tuple[int, int, int, int]:
    try:
        return topology_of(cfg)
    except ConfigError as e:
        raise ConfigError(e.errors + [
            "fleet.init ran before these arguments with another topology; build "
            "HSDPTrainingArguments first (it runs fleet.init with HSDP) or pass the same "
            "degrees"]) from None


def main_stack_patterns(model: paddle.nn.Layer) -> tuple[str, ...]:
    """What ``hsdp_wrap_modules='auto'`` wraps: ``('<path>.{*}',)`` for the model's
    longest ``LayerList`` (its decoder blocks); for a pipeline model (a
    ``PipelineLayer``, e.g. ``LlamaForCausalLMPipe``) the class the pipeline's layer
    list repeats (its decoder layers; a stage may hold one); ``()`` when it has
    neither."""
    descs = getattr(model, "_layers_desc", None)
    if descs is not None:  # every stage reads the whole pipeline's layer list alike
        counts = collections.Counter(d.layer_func.__name__ for d in descs
                                     if isinstance(getattr(d, "layer_func", None), type))
        return tuple(name for name, n in counts.most_common(1) if n > 1)
    best_path, best_len = None, 1
    for path, layer in model.named_sublayers():
        if isinstance(layer, paddle.nn.LayerList) and len(layer) > best_len:
            best_path, best_len = path, len(layer)
    return () if best_path is None else (f"{best_path}.{{*}}",)


def shard_for_training(model: paddle.nn.Layer, cfg: HSDPConfig) -> tuple[paddle.nn.Layer, Plan]:
    """``apply_config`` with the ``'auto'`` wrap pattern resolved for ``model``."""
    if cfg.sub_modules_to_wrap == (AUTO,):
        values = {name: getattr(cfg, name) for name in cfg.__dataclass_fields__}
        values["sub_modules_to_wrap"] = main_stack_patterns(model)
        cfg = HSDPConfig(**values)
    return apply_config(model, cfg)


@contextlib.contextmanager
def cpu_synchronize_is_a_no_op() -> Iterator[None]:
    """The Trainer calls ``paddle.device.synchronize()`` before scaling accumulated
    grads; on a CPU-only build that raises TypeError ("device should be gpu, xpu, ...")
    although there is nothing to wait for. Only on such builds, for the duration of
    the call, it does nothing; GPU builds are untouched."""
    if paddle.device.get_device() != "cpu" or paddle.is_compiled_with_cuda():
        yield
        return
    original = paddle.device.synchronize
    paddle.device.synchronize = lambda device=None: None
    try:
        yield
    finally:
        paddle.device.synchronize = original


def export_pretrained(model: paddle.nn.Layer, output_dir: str) -> None:
    """Write ``model`` (sharded, and split over tensor-parallel ranks and pipeline
    stages or not) as a directory PaddleFormers' ``from_pretrained`` loads exactly in
    one plain process. A collective: call it on every rank. Every sharded block,
    tensor-parallel slice and pipeline stage is joined on rank 0
    (:func:`paddle_hsdp.checkpoint.full_model.full_model`; a pipeline model's tensors
    under its one-process model's names), which writes them with the model class's own
    ``save_pretrained`` in Hugging Face layout (PaddleFormers' own transposes) and a
    config for one process (``tensor_model_parallel_size`` 1; ``architectures`` without
    ``Pipe``). Expert parallelism is refused before any collective.

    A :class:`LoRAModel` is exported merged: each adapted weight ``W + A @ B *
    scaling`` (the layer's own scaling), the adapters dropped, under the base model's
    names and with its class's ``save_pretrained``: the fine-tuned model, which the base
    class's ``from_pretrained`` loads alone (:func:`save_lora_adapters` writes the
    adapters instead)."""
    full = full_model(model, "export_pretrained")
    lora = model if isinstance(model, LoRAModel) else None
    if full is not None and lora is not None:
        full, model = _merged_lora(lora, full), lora.model
    if full is not None:
        config = copy.deepcopy(model.config)
        config.tensor_model_parallel_size = 1
        config.tensor_parallel_rank = 0
        if getattr(config, "is_lora", False):
            config.is_lora = False  # merged: a plain model
        # the model class's own save_pretrained (a sharded model's refuses: it would
        # write shards), given the full weights
        if isinstance(model, FSDPModule):
            # (the class fully_shard made is FSDP<cls>(FSDPModule, cls): the method is
            # cls's, which mypy cannot see behind FSDPModule)
            save = super(FSDPModule, model).save_pretrained  # type: ignore[misc]
        else:  # no unit at the root (an unsharded model): its class's own
            save = model.save_pretrained
        save(
            output_dir, is_main_process=True, state_dict=full, config_to_save=config,
            save_checkpoint_format="safetensors", save_to_hf=True, safe_serialization=True)
    if dist.get_world_size() > 1:
        dist.barrier()  # every rank returns once the directory is complete


_LORA_PREFIX = "model."  # LoRAModel holds the base model as ``.model``


def _merged_lora(lora: LoRAModel, full: dict) -> dict:
    """The base model's full state under its own names, every LoRA layer's adapters
    folded into its weight (rank 0's copy of ``full``, changed in place)."""
    base = {name[len(_LORA_PREFIX):]: t for name, t in full.items()
            if name.startswith(_LORA_PREFIX)}
    for path, layer in lora.model.named_sublayers():
        a, b = base.pop(f"{path}.lora_A", None), base.pop(f"{path}.lora_B", None)
        if a is None or b is None or getattr(layer, "merged", False):
            continue  # (merged: the weight already holds them)
        weight = f"{path}.weight"
        base[weight] = base[weight] + (a @ b * layer.scaling).astype(base[weight].dtype)
    return {name: t for name, t in base.items() if "lora_" not in name}


def save_lora_adapters(model: LoRAModel, output_dir: str) -> None:
    """Write a LoRA model's adapters as PaddleFormers' ``LoRAModel.save_pretrained``
    does without flex_checkpoint (``lora_model_state.pdparams``, ``lora_config.json``,
    the base model's ``config.json``), which ``LoRAModel.from_pretrained(base,
    output_dir)`` loads: the trainable tensors alone (the frozen base is not written),
    each joined from its shards (and tensor-parallel slices) on rank 0. A collective:
    call it on every rank. (PaddleFormers' own ``save_pretrained`` on a sharded LoRA
    model would run ``state_dict()``, a collective, on rank 0 alone.)"""
    full = full_model(model, "save_lora_adapters", trainable_only=True)
    if full is not None:
        os.makedirs(output_dir, exist_ok=True)
        adapters = {name[len(_LORA_PREFIX):]: t for name, t in full.items()
                    if name.startswith(_LORA_PREFIX)}
        paddle.save(adapters, os.path.join(output_dir, LORA_WEIGHTS_NAME))
        lora_config = LoRAConfig(**model.lora_config.to_dict())
        config = copy.deepcopy(getattr(model.model, "config_to_save", model.model.config))
        if lora_config.tensor_model_parallel_size > 1:  # joined: for one process
            lora_config.tensor_model_parallel_size = config.tensor_model_parallel_size = -1
        lora_config.save_pretrained(output_dir)
        config.save_pretrained(output_dir)
    if dist.get_world_size() > 1:
        dist.barrier()  # every rank returns once the directory is complete


def hsdp_muon(model: paddle.nn.Layer, args: TrainingArguments, params: Any,
              learning_rate: Any) -> Muon:
    """paddle_hsdp.Muon with the Trainer's ``muon_*``, ``adam_*``, ``weight_decay`` and
    ``max_grad_norm`` arguments; its decay rule (no decay for names holding ``bias`` or
    ``norm``) and, for Muon's choice of matrices, the structured names of
    ``muon_exclude_patterns`` (``muon_param_info``). ``params``: the trainable ones
    when None."""
    if params is None:
        params = [p for p in model.parameters() if not p.stop_gradient]
    decayed = {p.name for n, p in model.named_parameters()
               if not p.stop_gradient and not any(nd in n for nd in ("bias", "norm"))}
    clip = args.max_grad_norm
    return Muon(
        learning_rate=learning_rate, parameters=params, weight_decay=args.weight_decay,
        apply_decay_param_fun=lambda name: name in decayed,
        grad_clip=paddle.nn.ClipGradByGlobalNorm(clip) if clip > 0 else None,
        momentum=args.muon_momentum, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, adam_epsilon=args.adam_epsilon,
        ns_steps=args.muon_ns_steps, ns_coeff_type=args.muon_ns_coeff_type,
        ns_coeffs=args.muon_ns_coeffs, muon_version=args.muon_version,
        muon_extra_scale_factor=args.muon_extra_scale_factor,
        muon_param_info_map=muon_param_info(model, MUON_EXCLUDE if args.muon_exclude_patterns
                                            is None else args.muon_exclude_patterns))


def _newest_published(folder: str) -> str:
    """``" (NAME)"``: the newest sibling ``checkpoint-N`` of ``folder`` whose HSDP
    checkpoint was published, or ""."""
    parent, found = os.path.dirname(os.path.abspath(folder)), []
    for name in os.listdir(parent):
        step = name.rpartition("-")[2]
        if name.startswith("checkpoint-") and step.isdigit() and \
                os.path.isdir(os.path.join(parent, name, HSDP_CHECKPOINT_DIR)):
            found.append((int(step), name))
    return f" ({os.path.join(parent, max(found)[1])})" if found else ""


class HSDPTrainer(Trainer):
    """PaddleFormers' ``Trainer`` on an HSDP-sharded model; use it with
    :class:`HSDPTrainingArguments`. See the module docstring."""

    optimizer: Any  # (the Trainer's, set in its __init__ or by create_optimizer)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, HSDPTrainingArguments):
            raise TypeError(f"HSDPTrainer: args must be HSDPTrainingArguments, got "
                            f"{type(self.args).__name__} (it runs fleet.init with HSDP)")
        if self.optimizer is not None:
            raise ValueError("HSDPTrainer: optimizers=(optimizer, ...) was built on the "
                             "unsharded parameters; pass optimizers=(None, scheduler) and "
                             "let the trainer build it after sharding (or override "
                             "create_optimizer)")
        if not isinstance(self.model, FSDPModule):
            if self.args.tensor_model_parallel_size > 1:
                # what fleet's TensorParallel wrapper does, before sharding: the params
                # tensor parallelism does not split start equal on every mp rank
                broadcast_mp_parameters(self.model, fleet.get_hybrid_communicate_group())
            ep = _expert_degree(self.args)
            if ep > 1 and not (self.args.hsdp_config_resolved.expert_modules or any(
                    is_expert(p) for p in self.model.parameters())):
                raise ConfigError([  # alike on every rank: before any collective
                    f"HSDPTrainer: expert_model_parallel_size {ep}, but the model has no "
                    "expert parameters: mark them with paddle_hsdp.mark_expert_params "
                    "(global_indices: which experts this rank holds) or name them in "
                    "hsdp_config's expert_modules"])
            _, self.hsdp_plan = shard_for_training(self.model, self.args.hsdp_config_resolved)
            logger.info("HSDPTrainer: %s", self.hsdp_plan)
        # the MixedPrecisionPolicy casts (bf16 compute, fp32 shards and reduction);
        # the Trainer's autocast on top would cast the same ops again
        self.enable_autocast_context_manager = False
        self._hsdp_in_checkpoint = False

    # ------------------------------------------------------------ training
    def _wrap_model(self, model: paddle.nn.Layer, training: bool = True) -> paddle.nn.Layer:
        # No DataParallel, no MixPrecisionLayer: HSDP reduces the grads itself, and the
        # Trainer's fused all-reduce of DataParallel grads must not run on shards.
        if not self.args.use_hybrid_parallel:
            return model
        # Tensor or pipeline parallel: PaddleFormers' own wrappers (TensorParallel,
        # PipelineParallel and fleet's optimizer, sequence parallel's grad sync). With
        # dp 1 and its sharding stages off they add no data-parallel reduction.
        return super()._wrap_model(model, training)

    def create_optimizer(self, lr_scheduler: Any = None) -> paddle.optimizer.Optimizer:
        """``optim: muon``: paddle_hsdp.Muon over the shards (PaddleFormers' own asks for
        ``paddle.optimizer.Muon``, which Paddle 3.3 lacks, and its sharding stages);
        every other optimizer is PaddleFormers' own."""
        if self.optimizer is not None or not uses_muon(self.args):
            return super().create_optimizer(lr_scheduler)
        self.optimizer = hsdp_muon(self.model, self.args, self.optimizer_grouped_parameters,
                                   self.lr_scheduler if lr_scheduler is None else lr_scheduler)
        return self.optimizer

    def _wrap_distributed_optimizer(self, optimizer: paddle.optimizer.Optimizer,
                                    ) -> paddle.optimizer.Optimizer:
        # fleet's optimizer over the shards (its clip replaced by HSDP's, whose norm
        # log() reads); PaddleFormers' own version wraps HybridParallelClipGrad's
        # internals to log the norm, which the HSDP clip has no need of
        return fleet.distributed_optimizer(optimizer)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        with cpu_synchronize_is_a_no_op():
            return super().train(*args, **kwargs)

    def log(self, logs: dict[str, float], **kwargs: Any) -> None:
        if "loss" in logs and "global_norm" not in logs and self.optimizer is not None:
            norm = last_global_norm(self.optimizer)
            if norm is not None:
                logs["global_norm"] = round(norm, 8)  # HSDP's pre-clip norm of the step
        return super().log(logs, **kwargs)

    # ------------------------------------------------------------ checkpoints
    def _save_checkpoint(self, model: paddle.nn.Layer, metrics: dict | None = None) -> Any:
        self._hsdp_in_checkpoint = True
        try:
            return super()._save_checkpoint(model, metrics)
        finally:
            self._hsdp_in_checkpoint = False

    def save_model(self, output_dir: str | None = None, merge_tensor_parallel: bool = False,
                   last_fc_to_hf: bool = False) -> None:
        """Outside a checkpoint: a directory ``from_pretrained`` loads exactly, in
        Hugging Face layout whatever ``last_fc_to_hf`` says (every rank must call it);
        for a LoRA model its adapters in PaddleFormers' own format
        (:func:`save_lora_adapters`; :func:`export_pretrained` writes the merged model).
        Inside one, the weights go into the HSDP checkpoint instead (a LoRA model's
        adapters alone, and its adapter files beside them)."""
        lora = isinstance(self.model, LoRAModel)
        if not self.args.hsdp_checkpoint and (self._hsdp_in_checkpoint or not lora):
            # PaddleFormers' flex_checkpoint (GPU only; a LoRA model's final save is
            # ours below: its own save_pretrained would gather on rank 0 alone)
            return super().save_model(output_dir, merge_tensor_parallel, last_fc_to_hf)
        if self._hsdp_in_checkpoint:
            if output_dir is None:
                raise ValueError("HSDPTrainer.save_model inside a checkpoint: the "
                                 "Trainer passes the checkpoint's directory, got None")
            if lora:
                save_lora_adapters(self.model, output_dir)
            if self.args.ignore_save_lr_and_optim:  # no optimizer hook will run
                save_checkpoint(os.path.join(output_dir, HSDP_CHECKPOINT_DIR), self.model,
                                async_save=self.args.hsdp_async_save, trainable_only=lora)
            return None
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if lora:
            save_lora_adapters(self.model, output_dir)
        else:
            export_pretrained(self.model, output_dir)
        if self.args.should_save:
            if self.tokenizer is not None and self.args.save_tokenizer:
                self.tokenizer.save_pretrained(output_dir)
            paddle.save(self.args, os.path.join(output_dir, "training_args.bin"))
        return None

    def _save_flex_model_state(self, output_dir: str) -> None:
        if not self.args.hsdp_checkpoint:
            return super()._save_flex_model_state(output_dir)
        # written with the optimizer state by _save_flex_optimizer_state, in one save
        return None

    def _save_flex_optimizer_state(self, output_dir: str) -> None:
        if not self.args.hsdp_checkpoint:
            return super()._save_flex_optimizer_state(output_dir)
        save_checkpoint(os.path.join(output_dir, HSDP_CHECKPOINT_DIR), self.model,
                        self.optimizer, async_save=self.args.hsdp_async_save,
                        trainable_only=isinstance(self.model, LoRAModel))
        return None

    def _load_flex_checkpoint(self, resume_from_checkpoint: str) -> None:
        if not self.args.hsdp_checkpoint:
            return super()._load_flex_checkpoint(resume_from_checkpoint)
        path = os.path.join(resume_from_checkpoint, HSDP_CHECKPOINT_DIR)
        if not os.path.isdir(path):
            unfinished = glob.glob(glob.escape(path) + ".tmp-*")
            raise CheckpointError(
                f"HSDPTrainer: {resume_from_checkpoint!r} has no {HSDP_CHECKPOINT_DIR}/ "
                "folder: " + ("an asynchronous save (hsdp_async_save) was not published "
                              "before the job ended; resume from an earlier checkpoint"
                              f"{_newest_published(resume_from_checkpoint)}"
                              if unfinished else
                              "not a checkpoint written with hsdp_checkpoint=True"))
        optimizer = None if self.args.ignore_load_lr_and_optim else self.optimizer
        # a LoRA checkpoint holds the adapters alone; the frozen base is the one the
        # model was built from
        load_checkpoint(path, self.model, optimizer,
                        trainable_only=isinstance(self.model, LoRAModel))
        self._load_scheduler(resume_from_checkpoint)
        return None
