"""paddle_hsdp: hybrid sharded data parallel (HSDP) for PaddlePaddle fleet.

Importing the package teaches ``fleet.init`` the ``fsdp_outer_degree`` option, makes
gloo sub-group creation safe, and hooks the optimizer step boundary (every patch of
Paddle is in :mod:`paddle_hsdp.patches`); import it before ``fleet.init``.

Sub-packages, lowest first: ``comm`` (collectives), ``topology`` (layouts, fleet's
groups, meshes, byte formulas), ``optim`` (Muon), ``engine`` (what ``fully_shard``
builds and runs),
``patches`` (Paddle's classes changed), ``checkpoint`` and ``config``.
"""

import sys as _sys


def _starting_the_coordinator() -> bool:
    """Whether this process is ``python -m paddle_hsdp.ft.coordinator`` being started
    (the package is imported first, while ``sys.argv[0]`` is still ``-m``): it runs etcd
    alone, and a restarted coordinator must answer within the groups' outage budget, not
    after Paddle's seconds of import."""
    argv = getattr(_sys, "orig_argv", [])
    return _sys.argv[:1] == ["-m"] and "-m" in argv and \
        argv[argv.index("-m") + 1:argv.index("-m") + 2] == ["paddle_hsdp.ft.coordinator"]


COORDINATOR_ONLY = _starting_the_coordinator()

if not COORDINATOR_ONLY:  # the whole package, Paddle with it
    from . import comm, patches, topology  # noqa: F401  (paddle_hsdp.comm etc. as attributes)
    from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from .comm.collectives import CollectiveError
    from .comm.fingerprint import check_collectives
    from .comm.gather_tags import CollectiveMismatchError
    from .config.apply import apply_config
    from .config.schema import ConfigError, HSDPConfig, load_config
    from .engine.agreement import ReplicaMismatchError
    from .engine.api import (FSDPModule, forget, full_grads, full_state_dict, fully_shard,
                             set_zero_stage)
    from .engine.experts import mark_expert_params
    from .engine.memory import memory_report, reset_peak_memory
    from .engine.optimizer_state import full_optimizer_state_dict
    from .engine.optimizers import finish_grad_sync
    from .engine.placements import Owned, owned_matrices
    from .optim import Muon
    from .engine.policies import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy,
                                  OuterSyncPolicy)
    from .patches.clip import HSDPClipGradByGlobalNorm, last_global_norm
    from .topology.fleet import get_fsdp_outer_degree
    from .topology.mesh import create_mesh_groups

    patches.install()

__version__ = "0.1.0"

__all__ = [
    "CPUOffloadPolicy", "CheckpointError", "CollectiveError", "CollectiveMismatchError",
    "ConfigError", "FSDPModule", "HSDPClipGradByGlobalNorm", "HSDPConfig",
    "MixedPrecisionPolicy", "Muon", "OffloadPolicy", "OuterSyncPolicy", "Owned",
    "ReplicaMismatchError", "apply_config",
    "check_collectives",
    "create_mesh_groups", "finish_grad_sync", "forget", "full_grads",
    "full_optimizer_state_dict", "full_state_dict",
    "fully_shard", "get_fsdp_outer_degree", "last_global_norm", "load_checkpoint",
    "load_config", "mark_expert_params", "memory_report", "owned_matrices",
    "reset_peak_memory",
    "save_checkpoint", "set_zero_stage",
]
