#!/usr/bin/env bash
# Runs the tests on a machine with CUDA: Triton kernels compiled on the GPU (TRITON_INTERPRET off),
# tests spread over pytest-xdist workers, and a short summary at the end.
#
#   scripts/run_gpu_tests.sh            the whole suite (tests/)
#   scripts/run_gpu_tests.sh --quick    the tests marked gpu (tests/gpu and any other CUDA-only test), less the
#                                       sweeps marked exhaustive (one representative case of each stays)
#   scripts/run_gpu_tests.sh --quick -k cast     further arguments go to pytest
#
# MXTRAIN_TEST_WORKERS sets the number of xdist workers (default: the CPU count, at most 8, which
# keeps the largest GEMM tests of all workers at once within one GPU's memory);
# each worker gets CPU-count / workers torch threads (OMP_NUM_THREADS), so that the workers do
# not oversubscribe the cores. tests/distributed needs one GPU per rank (2): with fewer GPUs it
# runs on gloo with the GPU hidden, as in CPU CI. Without CUDA, use scripts/run_tests.sh.
set -uo pipefail
cd "$(dirname "$0")/.."

tier=full
args=()
for a in "$@"; do
    case "$a" in
        --quick) tier=quick ;;
        --full) tier=full ;;
        -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) args+=("$a") ;;
    esac
done

gpus=$(python3 -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)") || exit 2
if [[ "$gpus" -lt 1 ]]; then
    echo "run_gpu_tests.sh: no CUDA device here; scripts/run_tests.sh runs the suite on the CPU" >&2
    exit 2
fi
if [[ -n "${TRITON_INTERPRET:-}" && "${TRITON_INTERPRET}" != "0" ]]; then
    echo "note: TRITON_INTERPRET=${TRITON_INTERPRET} unset: the kernels are to be compiled on the GPU"
fi
unset TRITON_INTERPRET
if ! python3 -c "import xdist" 2>/dev/null; then
    echo "run_gpu_tests.sh: pytest-xdist is not installed (pip install pytest-xdist)" >&2
    exit 2
fi

ncpu=$(nproc)
workers=${MXTRAIN_TEST_WORKERS:-$(( ncpu < 8 ? ncpu : 8 ))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( ncpu / workers > 0 ? ncpu / workers : 1 ))}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # this checkout's mxtrain, whatever is installed

log_dir=$(mktemp -d)
start=$(date +%s)

# The CUDA C++ extension is built once, here, while the tests start (its build takes about a minute on a
# fresh machine): a worker that needs it waits on the build's lock file instead of building it again.
echo "== building the CUDA extension in the background (cached after the first build)"
python3 -c "
from mxtrain.kernels import cuda_cast
print('CUDA extension:', 'ready' if cuda_cast.library() is not None else 'unavailable: %s' % cuda_cast.extension_error())
" > "$log_dir/build.log" 2>&1 &
build_pid=$!
sleep 5  # the build takes its lock before any worker asks for the extension

# worksteal: a worker that runs out of tests takes queued ones from the others (a few tests take 30-40 s)
common=(-p no:cacheprovider -q -rfE --durations=15 -n "$workers")
status=0
if [[ "$tier" == quick ]]; then
    echo "== quick tier: tests -m 'gpu and not exhaustive', $workers workers, OMP_NUM_THREADS=$OMP_NUM_THREADS"
    python3 -m pytest "${common[@]}" --dist worksteal -m "gpu and not exhaustive" tests "${args[@]}" 2>&1 | tee "$log_dir/main.log"
    status=${PIPESTATUS[0]}
    parts=(main)
else
    echo "== whole suite: tests (tests/distributed apart), $workers workers, OMP_NUM_THREADS=$OMP_NUM_THREADS"
    python3 -m pytest "${common[@]}" --dist worksteal --ignore=tests/distributed tests "${args[@]}" 2>&1 \
        | tee "$log_dir/main.log"
    status=${PIPESTATUS[0]}
    # one torchrun per module fixture: keep each file on one worker
    if [[ "$gpus" -ge 2 ]]; then
        echo "== tests/distributed under NCCL ($gpus GPUs)"
        python3 -m pytest "${common[@]}" --dist loadfile tests/distributed "${args[@]}" 2>&1 \
            | tee "$log_dir/distributed.log"
    else
        echo "== tests/distributed on gloo, GPU hidden (one GPU here; NCCL needs one per rank)"
        CUDA_VISIBLE_DEVICES= python3 -m pytest "${common[@]}" --dist loadfile tests/distributed "${args[@]}" 2>&1 \
            | tee "$log_dir/distributed.log"
    fi
    rc=${PIPESTATUS[0]}
    [[ $rc -ne 0 && $rc -ne 5 && $status -eq 0 ]] && status=$rc   # 5: nothing selected (e.g. by -k)
    parts=(main distributed)
fi
[[ $status -eq 5 ]] && status=0
wait "$build_pid"
end=$(date +%s)

# ---------------------------------------------------------------------------------------- summary
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
[[ -z "$gpu_name" ]] && gpu_name=$(python3 -c "import torch; print(torch.cuda.get_device_name(0))" 2>/dev/null || echo "unknown GPU")
commit=$(git rev-parse --short=7 HEAD 2>/dev/null || echo "?")
[[ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]] && commit="$commit+changes"
versions=$(python3 -c "
import torch
try:
    import triton; t = triton.__version__
except ImportError:
    t = 'none'
print(f'torch {torch.__version__}, triton {t}')")
echo
echo "================================ run_gpu_tests.sh summary ================================"
echo "tier: $tier; commit $commit; $gpus x $gpu_name; $versions"
echo "xdist workers: $workers, OMP_NUM_THREADS=$OMP_NUM_THREADS; wall time: $(( (end - start) / 60 )) min $(( (end - start) % 60 )) s"
echo "$(tail -1 "$log_dir/build.log")"
for p in "${parts[@]}"; do
    # pytest's last line: "N passed, M failed, K skipped ... in T s"
    echo "$p: $(grep -E '(passed|failed|error|skipped|no tests ran)' "$log_dir/$p.log" | tail -1 | tr -d '=' | sed 's/^ *//')"
    grep -E '^(FAILED|ERROR) ' "$log_dir/$p.log" | head -20 | sed 's/^/  /'
done
echo "result: $([[ $status -eq 0 ]] && echo PASS || echo "FAIL (pytest exit $status)")"
echo "logs: $log_dir"
exit $status
