"""paddle_hsdp: hybrid sharded data parallel (HSDP) for PaddlePaddle fleet.

Importing the package teaches ``fleet.init`` the ``fsdp_outer_degree`` option, makes
gloo sub-group creation safe, and hooks the optimizer step boundary (see
:mod:`paddle_hsdp.optim`); import it before ``fleet.init``.
"""

from . import comm, topology  # noqa: F401
from .api import (FSDPModule, full_grads, full_state_dict, fully_shard,  # noqa: F401
                  memory_report, reset_peak_memory, set_zero_stage)
from .experts import mark_expert_params  # noqa: F401
from .policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy  # noqa: F401
from .apply import apply_config  # noqa: F401
from .config import ConfigError, HSDPConfig, load_config  # noqa: F401
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint  # noqa: F401
from .clip import HSDPClipGradByGlobalNorm, last_global_norm  # noqa: F401
from .fleet_ext import get_fsdp_outer_degree  # noqa: F401
from .mesh import create_mesh_groups  # noqa: F401
from .comm import CollectiveError  # noqa: F401
from .fingerprint import check_collectives  # noqa: F401
from .gather_check import CollectiveMismatchError  # noqa: F401
from .optim import finish_grad_sync  # noqa: F401
from . import checkpoint as _checkpoint
from . import clip as _clip
from . import cpu_compat as _cpu_compat
from . import fleet_ext as _fleet_ext
from . import gloo_groups as _gloo_groups
from . import optim as _optim
from . import state_dict as _state_dict

__version__ = "0.1.0"

_gloo_groups.install()
_cpu_compat.install()
_fleet_ext.install()
_optim.install()
_clip.install()
_state_dict.install()
_checkpoint.install()
