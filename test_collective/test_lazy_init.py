"""paddle.LazyGuard() models are materialised shard by shard (peak RSS below the model)."""

import json

from launcher import launch


def test_lazy_init_never_holds_the_full_model():
    log = launch(2, "worker_lazy.py", json.dumps({}), timeout=300)
    assert "LAZY rank 0" in log, log[-2000:]
