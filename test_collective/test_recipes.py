"""The recipes Paddle users already have in their scripts train right under HSDP 2 x 2
or are refused on every rank (see workers/worker_recipes.py): each training recipe
matches single-process training on the whole batch (losses, every parameter; float64
within workers/parity.py's bound, the fleet-optimizer recipe in float32)."""

RECIPES = ["distributed_model_after_fully_shard", "distributed_model_before_fully_shard",
           "clip_grad_norm_norm2", "clip_grad_norm_norminf", "direct_submodule_calls",
           "after_mismatch_error", "optimizer_built_first", "optimizer_checks",
           "state_dict_round_trip",
           "fused_allreduce_gradients"]


def test_recipes(hsdp_2x2_log):
    log = hsdp_2x2_log  # workers/worker_recipes.py, in the shared 2 x 2 launch (conftest.py)
    for name in RECIPES:
        assert log.count(f"RECIPE {name}:") == 1, (name, log[-3000:])
