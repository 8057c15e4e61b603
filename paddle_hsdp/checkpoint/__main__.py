"""``python -m paddle_hsdp.checkpoint inspect CKPT`` / ``consolidate CKPT OUT``."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
