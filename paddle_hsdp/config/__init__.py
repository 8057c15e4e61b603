"""Config-driven sharding: :mod:`.schema` (the YAML schema and its checks),
:mod:`.patterns` (module-path patterns), :mod:`.plan` (the dry run of a config on a
model), :mod:`.apply` (``apply_config``) and :mod:`.planner` (time per layout of a
cluster, the recommendation). The command line is :mod:`paddle_hsdp.__main__`."""
