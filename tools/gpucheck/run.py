"""What every check of a launch shares (class Run): the rank, the layouts, the data and
the single-device reference, TinyLM sharded and its optimizer, the rows so far."""

from __future__ import annotations

import json
import os

from gpucheck.options import other_layout, parse_layout

MICRO, PER_RANK, CLIP = 2, 2, 0.2  # the parity workers' settings (worker_mesh.py)


class Run:
    """What every check shares: the process's rank, layout, data and references."""

    def __init__(self, args):
        import paddle
        import paddle.distributed as dist

        import common
        import models

        self.args, self.paddle, self.dist = args, paddle, dist
        self.common, self.models = common, models
        world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
        self.layout = parse_layout(args.layout or f"1x{world}", world)
        self.other = other_layout(self.layout, world)
        common.init_fleet({"sharding_degree": world, "outer": self.layout[0]})
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.out = args.out
        self.rows: list = []
        self.done: list = []  # checks finished, for --report to name the missing ones
        self._data = self._ref = None

    # shared inputs
    def data(self):
        if self._data is None:
            self._data = self.models.batches(self.args.steps, MICRO, self.world, PER_RANK)
        return self._data

    def reference(self):
        """Single-GPU training on the whole batch (each rank computes it, unsharded)."""
        if self._ref is None:
            self._ref = self.models.train_reference(self.data(), self.world, PER_RANK, CLIP)
        return self._ref

    def tinylm(self, **kwargs):
        model = self.models.shard_tinylm(self.models.build_model(), **kwargs)
        return model, self.models.make_optimizer(model, model.parameters(), CLIP)

    def mesh(self, layout):
        from paddle.distributed import ProcessMesh

        outer, inner = layout
        ranks = list(range(self.world))
        if outer == 1:
            return ProcessMesh(ranks)
        return ProcessMesh([ranks[i * inner:(i + 1) * inner] for i in range(outer)],
                           dim_names=["outer", "inner"])

    def add(self, check: str, new_rows: list):
        self.rows += new_rows
        self.done.append(check)
        if self.rank == 0:
            self.save()

    def save(self):
        os.makedirs(os.path.join(self.out, "results"), exist_ok=True)
        with open(os.path.join(self.out, "results", f"{self.args.phase}.json"), "w") as f:
            json.dump({"meta": self.meta(), "planned": self.args.only, "done": self.done,
                       "rows": self.rows}, f, indent=1)

    def meta(self) -> dict:
        paddle = self.paddle
        version = getattr(paddle, "version", None)

        def ask(fn):
            try:
                return str(fn())
            except Exception:  # an older or newer Paddle without it
                return "?"

        return {"world": self.world, "layout": "x".join(map(str, self.layout)),
                "steps": self.args.steps, "paddle": paddle.__version__,
                "cuda": ask(lambda: version.cuda()), "nccl": ask(lambda: version.nccl()),
                "gpu": ask(paddle.device.cuda.get_device_name)
                if not self.args.cpu_rehearsal else "CPU",
                "rehearsal": self.args.cpu_rehearsal,
                "tf32_override": os.environ.get("NVIDIA_TF32_OVERRIDE")}


def synchronize(run: Run) -> None:
    if not run.args.cpu_rehearsal:
        run.paddle.device.synchronize()
