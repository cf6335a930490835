#!/usr/bin/env bash
# The multi-GPU measurements of one 4-GPU host (issue 33), in phases that each fit one device call:
#
#   bash benchmarks/multigpu.sh OUT PHASE...      (from the repo root; PYTHONPATH=. is set here)
#
# Phases (each bounded by its own timeout, and all by DEADLINE_S; rows are appended and flushed as they come):
#   gputests   the Mosaic kernel GPU suite (test_kernels_gpu.py TestMosaicGPU), before any timing
#   scaling    sparse ring fwd+bwd at 512K on 1x4 1x1 2x2 (both ring orders) 1x2, traced, dense ring at 1x4
#   long       sparse ring at 1M on 1x4 and 1x1 (no dense ring: ~45 s a step on one GPU)
#   s256       sparse ring at 256K on the scaling meshes, traced, dense ring at 1x4
#   weak       weak scaling: 128K tokens per GPU (S = 128K x P) on 1x1 1x2 1x4 2x2, traced, no dense ring
#   train      the dense ring step vs cuDNN on GPU 0 (kernels.py --ring-step), then the trainer at 512K on NGPU GPUs
#              (1xNGPU): MTraining vs the dense ring, Qwen2.5-0.5B shape (TRAIN_CFG)
#   multiproc  the multi-host recipe of docs/training.md on one box: 2 processes x 2 GPUs (CUDA_VISIBLE_DEVICES),
#              mesh [2, 2], vs one process on the same [2, 2] mesh and on [1, 4]; 256K, 3 steps, deterministic (NGPU below)
# Set MTRAINING_COMMIT to the commit the tree is (the device copy has no .git). NGPU (default 4) is the
# box's GPU count: on a 2-GPU box `NGPU=2 SCALING_MESHES="1x2 1x1" DENSE_MESHES=1x2` (multiproc: 2 processes
# x 1 GPU, mesh [2, 1], vs one process on [2, 1] and [1, 2]). TAG names the sparse_ring run (rows' `run`).
set -uo pipefail
NGPU=${NGPU:-4}; HALF=$((NGPU / 2))
OUT=${1:?usage: multigpu.sh OUT PHASE...}; shift
export PYTHONPATH=. PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT"
CFG=configs/qwen2.5-0.5b-128k.yaml
# A device call returns at most 8 files: however the script ends, drop the bulky per-case artefacts (HLO
# text, traces, schedules) so that the row files come back. DEADLINE_S (seconds, e.g. 580 in a 600 s call)
# clamps every phase's timeout to what is left of it, so that the script ends on its own, cleaned up,
# before the call's limit; a TERM from outside is handled too, but only once the running command ends.
START=$(date +%s)
lim() {  # lim N: N seconds, or what is left before DEADLINE_S (minus 10 s for the cleanup), at least 1
  local want=$1
  if [ "${DEADLINE_S:-0}" -gt 0 ]; then
    local left=$((START + DEADLINE_S - $(date +%s) - 10))
    [ "$left" -lt "$want" ] && want=$left
    [ "$want" -lt 1 ] && want=1
  fi
  echo "$want"
}
cleanup() { rm -rf "$OUT"/*/*.hlo.txt "$OUT"/*/profile_* "$OUT"/*/schedule_*; }
trap cleanup EXIT
trap 'echo "multigpu.sh: stopped by a signal during phase ${phase:-none}"; exit 143' TERM INT

# one sparse_ring run: ring_phase NAME TIMEOUT ARGS... -> rows in $OUT/NAME (run $TAG), HLO / traces / schedules removed
ring_phase() {
  local name=$1 limit=$2; shift 2
  timeout $(lim "$limit") python -m benchmarks.sparse_ring "$@" --repeat 3 --tag "${TAG:-untagged}" --out "$OUT/$name" 2>&1 \
    | grep -v '^{' | grep -v '^    ' | grep -v '^/device'
  rm -rf "$OUT/$name"/*.hlo.txt "$OUT/$name"/profile_* "$OUT/$name"/schedule_*
}

for phase in "$@"; do
  echo "=== phase $phase $(date -u +%T)"
  case $phase in
    gputests)
      MTRAINING_TEST_GPU=1 timeout $(lim 200) python -m pytest -q -x -m gpu tests/test_kernels_gpu.py -k TestMosaicGPU -p no:cacheprovider 2>&1 | tail -4 ;;
    scaling)
      # (no --check at 512K on an H100: the sampled-row reference needs 8 GiB buffers; the GPU suite checks the kernels)
      ring_phase scaling ${SCALING_TIMEOUT:-480} --lengths 524288 --meshes ${SCALING_MESHES:-1x4 1x1 2x2 1x2} \
        --ring-orders hierarchical flat --profile --dense-meshes ${DENSE_MESHES:-1x4} ;;
    long)
      ring_phase long 300 --lengths 1048576 --meshes 1x4 1x1 --skip-dense ;;
    s256)
      ring_phase s256 ${SCALING_TIMEOUT:-400} --lengths 262144 --meshes ${SCALING_MESHES:-1x4 1x1 2x2 1x2} \
        --ring-orders hierarchical flat --profile --dense-meshes ${DENSE_MESHES:-1x4} ;;
    weak)
      ring_phase weak ${SCALING_TIMEOUT:-400} --per-gpu-length 131072 --lengths 131072 \
        --meshes ${WEAK_MESHES:-1x1 1x2 1x4 2x2} --ring-orders hierarchical --profile --skip-dense ;;
    train)
      # TRAIN_CFG (default the 0.5B config), TRAIN_TAG names the output folders, TRAIN_DENSE=0 skips the dense ring,
      # TRAIN_MT=0 the MTraining run; TRAIN_SET: extra --set overrides (e.g. "optim.offload=optimizer")
      tcfg=${TRAIN_CFG:-$CFG}; ttag=${TRAIN_TAG:-}
      # the dense ring's per-step kernel against cuDNN on one chunk (0.5B shape: 14 / 2 heads, head_dim 64; 512K / NGPU)
      [ "${TRAIN_RINGSTEP:-1}" = 1 ] && CUDA_VISIBLE_DEVICES=0 timeout $(lim 200) python -m benchmarks.kernels --only-sweeps --reps 5 \
        --ring-step $((524288 / NGPU)),14,2,64 --impls auto --json "$OUT/ring_step.json" 2>&1 | grep "^ring step"
      [ "${TRAIN_MT:-1}" = 1 ] && timeout $(lim ${TRAIN_TIMEOUT:-300}) python -m benchmarks.train_throughput --config $tcfg --mesh 1x$NGPU \
        --seq-lens 524288 --backends mtraining --warmup 1 --steps 2 --timeout $(lim ${TRAIN_TIMEOUT:-300}) ${TRAIN_PROFILE:+--profile} \
        ${TRAIN_SET:+--set $TRAIN_SET} --out "$OUT/train_mt$ttag" 2>&1 | tail -6
      [ "${TRAIN_DENSE:-1}" = 1 ] && timeout $(lim 300) python -m benchmarks.train_throughput --config $tcfg --mesh 1x$NGPU \
        --seq-lens 524288 --backends ring --warmup 0 --steps 1 --timeout $(lim 280) ${TRAIN_SET:+--set $TRAIN_SET} \
        --out "$OUT/train_ring$ttag" 2>&1 | tail -6 ;;
    multiproc)
      # deterministic=true (MP_DETERMINISTIC=0: off): bit-reproducible steps, so the runs can agree exactly
      common=(--config $CFG data.seq_len=262144 steps=${MP_STEPS:-3} eval.every=0 checkpoint.every=0 logging.every=1
              optim.grad_accum=1 model.dense_backend=ring deterministic=$([ "${MP_DETERMINISTIC:-1}" = 1 ] && echo true || echo false))
      first=$(seq -s, 0 $((HALF - 1))); second=$(seq -s, $HALF $((NGPU - 1)))
      CUDA_VISIBLE_DEVICES=$first timeout $(lim ${MP_TIMEOUT:-300}) python -m mtraining_jax.apps.train "${common[@]}" mesh.shape=[2,$HALF] \
        run_dir="$OUT/runs/mp" --coordinator-address localhost:12355 --num-processes 2 --process-id 0 > "$OUT/mp0.log" 2>&1 &
      CUDA_VISIBLE_DEVICES=$second timeout $(lim ${MP_TIMEOUT:-300}) python -m mtraining_jax.apps.train "${common[@]}" mesh.shape=[2,$HALF] \
        run_dir="$OUT/runs/mp" --coordinator-address localhost:12355 --num-processes 2 --process-id 1 > "$OUT/mp1.log" 2>&1
      wait
      tail -3 "$OUT/mp0.log"
      timeout $(lim ${MP_TIMEOUT:-240}) python -m mtraining_jax.apps.train "${common[@]}" mesh.shape=[2,$HALF] run_dir="$OUT/runs/sp2x" 2>&1 | tail -3
      [ "${MP_1X4:-1}" = 1 ] && timeout $(lim 240) python -m mtraining_jax.apps.train "${common[@]}" mesh.shape=[1,$NGPU] run_dir="$OUT/runs/sp1x" 2>&1 | tail -3
      for r in mp sp2x sp1x; do
        [ -f "$OUT/runs/$r/metrics.jsonl" ] && sed "s/^/{\"run\": \"$r\", \"row\": /; s/\$/}/" "$OUT/runs/$r/metrics.jsonl"
      done > "$OUT/multiproc_metrics.jsonl"
      rm -rf "$OUT/runs" ;;
    *) echo "unknown phase $phase" ;;
  esac
done
echo "=== done $(date -u +%T)"
