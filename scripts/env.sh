#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv, then run a command in it.
# Usage: scripts/env.sh COMMAND [ARGS...]   e.g. scripts/env.sh pytest -q
# Re-installs only when pyproject.toml changed since the last install.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${TPLAB_VENV:-.venv}
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac

if [ ! -x "$VENV/bin/python" ]; then
  echo "[tplab] creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.tplab-installed"
want=$(cat pyproject.toml scripts/constraints.txt | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[tplab] installing tplab and its dependencies into $VENV (torch==2.13.0, CPU wheel where available)"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  # the exact torch this repository is tested with; pyproject.toml only says torch>=2.10
  "$VENV/bin/python" -m pip install --quiet -c scripts/constraints.txt -e ".[dev,hf,frameworks]"
  # torchtitan without its own requirements (pyproject.toml's frameworks extra says why)
  "$VENV/bin/python" -m pip install --quiet --no-deps -c scripts/constraints.txt torchtitan==0.3.0
  echo "$want" > "$stamp"
fi

# Where Python is told not to write bytecode (PYTHONDONTWRITEBYTECODE, set on some
# machines and containers), every process that imports tplab (each rank, each kernel, each
# test worker) would compile its modules again: compile them once here (quick when current).
"$VENV/bin/python" -m compileall -q -j 0 tplab tests >/dev/null

# Keep Jupyter/IPython state out of the user's home: it lives in .tplab-state/ here.
state="$PWD/.tplab-state"
mkdir -p "$state" && chmod 700 "$state"
export IPYTHONDIR="$state/ipython" JUPYTER_CONFIG_DIR="$state/jupyter-config" \
  JUPYTER_RUNTIME_DIR="$state/jupyter-runtime" JUPYTER_DATA_DIR="$state/jupyter-data" \
  JUPYTERLAB_SETTINGS_DIR="$state/lab-settings" JUPYTERLAB_WORKSPACES_DIR="$state/lab-workspaces" \
  MPLCONFIGDIR="$state/matplotlib"
# JupyterLab would ask, and then try, to fetch news from the internet: say no once.
news="$state/lab-settings/@jupyterlab/apputils-extension/notification.jupyterlab-settings"
if [ ! -f "$news" ]; then
  mkdir -p "$(dirname "$news")" && echo '{"fetchNews": "false", "checkForUpdates": false}' > "$news"
fi
export PATH="$VENV/bin:$PATH"
exec "$@"
