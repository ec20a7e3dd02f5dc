#!/usr/bin/env bash
# Fault drill for FSDP2 + MX all-gathers + DCP checkpoints, runnable on CPU (gloo) in a few minutes.
#
#   scripts/fault_resume_check.sh            # 2 ranks; env: NPROC STEPS SAVE_EVERY FAULT_STEP FAULT_RANK WORK RECIPES
#
# For each recipe in RECIPES (default: MXFP8; FP8 DelayedScaling, whose amax histories and scales
# must come back; MXFP4 with seeded stochastic rounding of the gradients, whose generators must):
# 1. an uninterrupted run of examples/train_lm.py (tiny GPT on Jane Austen);
# 2. the same run with --ckpt-dir/--save-every, where rank FAULT_RANK SIGKILLs itself at step
#    FAULT_STEP (MXTRAIN_FAULT_STEP/MXTRAIN_FAULT_RANK): torchrun must fail and name the killed rank;
# 3. --resume: continues from the newest complete checkpoint, so only the steps since it are redone;
# 4. the resumed loss history and eval loss must equal the uninterrupted run's exactly.
# Exit status 0 when all of that holds for every recipe. Needs the Austen corpus (scripts/install_data.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-2}
STEPS=${STEPS:-12}
SAVE_EVERY=${SAVE_EVERY:-4}
FAULT_STEP=${FAULT_STEP:-9}
FAULT_RANK=${FAULT_RANK:-1}
WORK=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/mxtrain_fault.XXXXXX")}
RECIPES=${RECIPES:-"mxfp8 fp8_delayed mxfp4:grad_rounding=stochastic,seed=0"}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONWARNINGS=ignore PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

train() {
    python -m torch.distributed.run --standalone --nproc_per_node="$NPROC" examples/train_lm.py --recipe "$RECIPE" \
        --steps "$STEPS" --batch-size 4 --seq-len 64 --d-model 64 --layers 2 --heads 2 --warmup 2 \
        --eval-batches 2 --device cpu --no-progress "$@"
}
fail() { echo "FAIL: $*"; echo "logs in $WORK"; exit 1; }

for RECIPE in $RECIPES; do
    W="$WORK/${RECIPE//[:=,]/_}"
    mkdir -p "$W"
    echo "== $RECIPE 1/3 uninterrupted run ($NPROC ranks, $STEPS steps)"
    train --json "$W/clean.json" >"$W/clean.log" 2>&1 || fail "uninterrupted run failed (see $W/clean.log)"

    echo "== $RECIPE 2/3 rank $FAULT_RANK killed at step $FAULT_STEP (checkpoints every $SAVE_EVERY steps)"
    MXTRAIN_FAULT_STEP=$FAULT_STEP MXTRAIN_FAULT_RANK=$FAULT_RANK \
        train --ckpt-dir "$W/ckpt" --save-every "$SAVE_EVERY" --json "$W/crash.json" >"$W/crash.log" 2>&1
    rc=$?
    [ $rc -ne 0 ] || fail "the run with a killed rank exited 0"
    grep -q "ChildFailedError" "$W/crash.log" && grep -q "SIGKILL" "$W/crash.log" \
        || fail "torchrun did not report the killed rank (see $W/crash.log)"
    echo "   torchrun exit status $rc; it reports:"
    grep -E "^\s*(rank|exitcode)\s*:" "$W/crash.log" | sed 's/^/     /'
    echo "   checkpoints on disk: $(ls "$W/ckpt" | tr '\n' ' ')"

    echo "== $RECIPE 3/3 resume"
    train --ckpt-dir "$W/ckpt" --save-every "$SAVE_EVERY" --resume --json "$W/resumed.json" \
        >"$W/resumed.log" 2>&1 || fail "resumed run failed (see $W/resumed.log)"
    grep "resumed from" "$W/resumed.log" | sed 's/^/   /'

    python - "$W" "$FAULT_STEP" "$SAVE_EVERY" <<'PY' || fail "resumed run differs from the uninterrupted one"
import json, sys
work, fault, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
clean = json.load(open(f"{work}/clean.json"))["results"][0]
resumed = json.load(open(f"{work}/resumed.json"))["results"][0]
last_ckpt = fault // every * every
print(f"   steps lost to the crash: {fault - last_ckpt} (crash at step {fault}, last checkpoint at step {last_ckpt})")
same = clean["history"] == resumed["history"] and clean["eval_loss"] == resumed["eval_loss"]
print(f"   final train loss {resumed['history'][-1]:.6f} vs uninterrupted {clean['history'][-1]:.6f}; "
      f"eval loss {resumed['eval_loss']:.6f} vs {clean['eval_loss']:.6f}: {'identical' if same else 'DIFFERENT'}")
sys.exit(0 if same else 1)
PY
done
echo "OK ($RECIPES): killed rank reported, resumed from the last checkpoint, same losses as the uninterrupted run"
