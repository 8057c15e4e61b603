"""Every change paddle_hsdp makes to Paddle goes through patches.patching.replace:
recorded once, with the original and a reason, and still in force."""

import paddle_hsdp
from paddle_hsdp import patches


def test_every_patch_is_recorded_once_with_a_reason():
    active = patches.active()
    targets = [p.target for p in active]
    assert len(targets) == len(set(targets)), "a patch was applied twice"
    assert all(p.why for p in active)
    for expected in ("Optimizer._apply_optimize", "Optimizer.clear_grad", "Layer.state_dict",
                     "Layer.set_state_dict", "AdamW.sharded_state_dict",
                     "HybridCommunicateGroup.get_fsdp_inner_group", "clip_grad_norm_",
                     "_new_process_group_impl", "sync_params_buffers", "c_identity",
                     # issue 32: the 3D paths on CPU, sequence parallel, pipelines
                     "c_concat", "c_softmax_with_cross_entropy", "c_embedding",
                     "reduce_scatter", "ParallelEnv._device_id", "_batched_p2p_ops",
                     "_p2p_ops", "PipelineParallel._broadcast_final_loss",
                     "PipelineLayer.forward", "create_non_fused_allreduce_gradient_hook",
                     "create_fused_allreduce_gradient_hook"):
        assert any(t.endswith(expected) for t in targets), (expected, targets)


def test_patches_are_in_force_and_install_is_idempotent():
    before = len(patches.active())
    patches.install()  # import paddle_hsdp already did
    assert len(patches.active()) == before
    for p in patches.active():
        assert p.added or getattr(p.owner, p.name) is not p.original, p.target
    assert patches.describe().count("\n") == before - 1
    assert paddle_hsdp.patches is patches
