"""Everything paddle_hsdp changes in Paddle's own classes and functions, one file per
concern; each file's docstring says what it patches and why. Every patch goes through
:func:`.patching.replace`, which records the original and why; :func:`active` lists
them (:func:`describe` as text). :func:`install` applies
them all, once (``import paddle_hsdp`` calls it), in this order:

* :mod:`.gloo_groups`: gloo sub-group creation, a rendezvous store per group;
* :mod:`.cpu_compat`: Paddle's tensor-parallel layers and sequence parallel on CPU
  (gloo; the ops' CPU definitions in :mod:`.cpu_mp_ops`);
* :mod:`.cpu_pipeline`: Paddle's pipeline schedule (``PipelineLayer``, ``train_batch``)
  on CPU (gloo);
* :mod:`.gloo_groups` again: gloo collectives wait for paddle_hsdp's communication thread;
* :mod:`.fleet`: the ``fsdp_outer_degree`` strategy option, ``fleet.init``, the HCG's
  HSDP methods, parameter broadcasts that skip shards;
* :mod:`.optim`: the optimizer step boundary (``_apply_optimize``, ``clear_grad``,
  ``GradScaler``, ``HybridParallelOptimizer``);
* :mod:`.mix_precision`: ``MixPrecisionOptimizer.clear_grad`` (Paddle's master-grad
  wrapper) ends the step as ``clear_grad`` does;
* :mod:`.clip`: ``paddle.nn.utils.clip_grad_norm_`` / ``clip_grad_value_``;
* :mod:`.pipeline`: a sharded ``PipelineLayer``'s forward, which ``PipelineParallel``
  calls directly, runs through its hooks;
* :mod:`.sequence_parallel`: sequence parallel's grad all-reduce on HSDP parameters,
  whichever order Paddle's hooks are registered in;
* :mod:`.state_dict`: ``Layer.state_dict`` / ``set_state_dict`` on sharded models;
* :mod:`.flex_optimizer`: ``AdamW.sharded_state_dict`` over HSDP shards;
* :mod:`.shard_edits`: ``Tensor.set_value`` / ``copy_`` on a shard mark it edited;
* :mod:`.jit`: ``paddle.jit.to_static`` refused on sharded models.
"""

from __future__ import annotations

from . import (clip, cpu_compat, cpu_pipeline, flex_optimizer, fleet, gloo_groups, jit,
               mix_precision, optim, pipeline, sequence_parallel, shard_edits, state_dict)
from .patching import active, describe

__all__ = ["active", "describe", "install"]


def install() -> None:
    """Apply every patch (each is idempotent)."""
    gloo_groups.install()
    cpu_compat.install()
    cpu_pipeline.install()
    gloo_groups.serialize_collectives()
    fleet.install()
    optim.install()
    mix_precision.install()
    clip.install()
    pipeline.install()
    sequence_parallel.install()
    state_dict.install()
    flex_optimizer.install()
    shard_edits.install()
    jit.install()
