"""``python -m paddle_hsdp.train [--nproc_per_node N] [--log_dir DIR] config.yaml
[key=value ...]``: a ``paddleformers-cli train`` YAML trained with HSDP.

The same YAML as the CLI's, with ``fsdp_outer_degree`` (and any other HSDP key,
docs/paddleformers.md) added; ``custom_register_path`` is not needed. ``key=value``
pairs override the YAML's, as with the CLI. With ``--nproc_per_node N`` it starts N
ranks on this machine itself (``python -m paddle.distributed.launch``, logs in
``--log_dir``, default ``paddleformers_dist_log`` like the CLI's); without it, it runs
as one rank of a launch you started (or alone). ``--plugin-path`` prints the path of
the ``custom_register_path`` plugin for the CLI itself.

Each rank installs paddle_hsdp.integrations.paddleformers_cli (HSDP's arguments and
trainer in the CLI's workflow) and runs the CLI's own training function with the
YAML's keys.
"""

from __future__ import annotations

import os
import subprocess
import sys

if __name__ == "__main__" and sys.path and os.path.abspath(sys.path[0]) == \
        os.path.dirname(os.path.abspath(__file__)):
    # started as a script by the launcher: this package's folder must not shadow
    # top-level modules (its config/, patches/ ...)
    sys.path.pop(0)

import argparse  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Sequence  # noqa: E402

USAGE = __doc__.split("\n\n")[0]
# what paddleformers-cli sets for its ranks before it launches them (cli/cli.py)
CLI_ENV = {"FLAGS_set_to_1d": "False", "NVIDIA_TF32_OVERRIDE": "0",
           "FLAGS_dataloader_use_file_descriptor": "False"}


def plugin_path() -> str:
    return str(Path(__file__).resolve().parent / "integrations" / "cli_plugin.py")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m paddle_hsdp.train", usage=USAGE)
    parser.add_argument("--nproc_per_node", type=int, default=None)
    parser.add_argument("--log_dir", default="paddleformers_dist_log")
    parser.add_argument("--plugin-path", action="store_true")
    parser.add_argument("config", nargs="?")
    parser.add_argument("overrides", nargs="*")
    return parser


def read_config(path: str, overrides: Sequence[str]) -> dict:
    """The YAML's keys with ``key=value`` overrides, as the CLI reads them."""
    import yaml
    from omegaconf import OmegaConf

    if not path.endswith((".yaml", ".yml")):
        raise SystemExit(f"python -m paddle_hsdp.train: {path!r} is not a .yaml / .yml file")
    loaded = yaml.safe_load(Path(path).absolute().read_text()) or {}
    merged = OmegaConf.merge(loaded, OmegaConf.from_cli(list(overrides)))
    return OmegaConf.to_container(merged)  # type: ignore[return-value]


def launch(nproc: int, log_dir: str, argv: Sequence[str]) -> int:
    """Start ``nproc`` ranks of this module on this machine; their exit status."""
    env = dict(os.environ)
    for key, value in CLI_ENV.items():
        env.setdefault(key, value)
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc),
           "--log_dir", log_dir, str(Path(__file__).resolve()), *argv]
    return subprocess.call(cmd, env=env)


def run(config: dict) -> None:
    """One rank: HSDP's arguments and trainer in the CLI's workflow, then its training."""
    # (importing it imports paddle_hsdp first, whose patches must precede fleet.init)
    from paddle_hsdp.integrations.paddleformers_cli import install

    install()
    if config.get("custom_register_path") == plugin_path():
        config.pop("custom_register_path")  # installed above
    from paddleformers.cli.train.tuner import run_tuner

    run_tuner(config)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.plugin_path:
        print(plugin_path())
        return 0
    if args.config is None:
        print(USAGE, file=sys.stderr)
        return 2
    config = read_config(args.config, args.overrides)  # a bad file fails here, at once
    if args.nproc_per_node is not None and "PADDLE_TRAINER_ID" not in os.environ:
        return launch(args.nproc_per_node, args.log_dir, [args.config, *args.overrides])
    run(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
