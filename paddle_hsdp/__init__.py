"""paddle_hsdp: hybrid sharded data parallel (HSDP) for PaddlePaddle fleet.

Importing the package teaches ``fleet.init`` the ``fsdp_outer_degree`` option and makes
gloo sub-group creation safe; import it before ``fleet.init``.
"""

from . import comm, topology  # noqa: F401
from .fleet_ext import get_fsdp_outer_degree  # noqa: F401
from . import fleet_ext as _fleet_ext
from . import gloo_groups as _gloo_groups

__version__ = "0.1.0"

_gloo_groups.install()
_fleet_ext.install()
