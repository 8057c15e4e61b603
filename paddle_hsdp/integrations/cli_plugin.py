"""PaddleFormers' ``custom_register_path`` plugin: put this file's path in a
``paddleformers-cli train`` YAML (``custom_register_path: ...``; ``python -m
paddle_hsdp.train --plugin-path`` prints it) with ``fsdp_outer_degree`` and the CLI
trains with HSDP. The CLI executes this file before it parses the rest of the YAML;
see paddle_hsdp/integrations/paddleformers_cli.py for what it changes."""

# (importing it imports paddle_hsdp first, whose patches must precede fleet.init)
from paddle_hsdp.integrations.paddleformers_cli import install

install()
