#!/usr/bin/env bash
# The GPU suite (`pytest -m gpu`) on one GPU as five concurrent pytest processes: the suite is
# compile-bound (Mosaic kernels compile for ~25 s each), so the groups overlap their compilation on
# the host's cores while sharing the GPU: each group takes the GiB of GPU memory its entry names first
# (as XLA_PYTHON_CLIENT_MEM_FRACTION of the card's memory). Groups start together while their GiB sum
# to at most 0.83 of the card (the rest is for what each process allocates outside XLA's pool: CUDA
# graphs, cuBLAS handles, Mosaic modules; shares summing to 0.98 ran out there on 2026-11-28); a group
# that does not fit waits for the running ones (an H200's 139 GiB holds all five; an H100's 79 GiB
# runs 0-1, then 2-4). XLA's autotuner is off (its profiling buffers for the float32 references at
# 16K ran out of memory at a 0.18 share); it picks configurations, not results.
# Usage: bash tests/gpu_suite.sh [LOG_DIR] (GPU_SUITE_GROUPS=0,1 runs only those groups;
# GPU_SUITE_GPUS=0,1,2,3 spreads the groups over those GPUs, group i on the (i mod n)-th, each
# GPU's memory then its own); exits non-zero if any group fails, and prints each group's summary.
# The logs are verbose: each test's id is written as it starts, so a group stopped from outside (a
# kernel that hangs: results/kernels/kernels.md run 38) ends its log, and its summary line here, with
# the test that hung.
# Serially, `python -m pytest -m gpu` runs the same tests.
set -u
cd "$(dirname "$0")/.."
log_dir=${1:-$(mktemp -d)}
mkdir -p "$log_dir"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0"
groups=(
  "30 tests/test_kernels_gpu.py -k TestMosaicGPU and (merges or walks_and_streams or dense_index or fully_masked)"
  "30 tests/test_kernels_gpu.py -k TestMosaicGPU and not (merges or walks_and_streams or dense_index or fully_masked)"
  "18 tests/test_kernels_gpu.py tests/test_index_programs.py tests/test_window_scores.py -k not TestMosaicGPU"
  "18 tests/test_ring.py tests/test_sparsity_fidelity.py"
  "18 tests/test_mtraining_attention.py tests/test_bf16_gradients.py"
)
gpu_mib() {  # memory of GPU $1 (an index into CUDA_VISIBLE_DEVICES' numbering as nvidia-smi gives it)
  nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i "$1" 2>/dev/null | head -n 1
}
IFS=, read -r -a gpus <<<"${GPU_SUITE_GPUS:-0}"
declare -A used=()
pids=()
ran=()
status=0
# a suite stopped by a signal stops its groups too (`timeout` signals the whole process group; a plain
# `kill` of this script left its groups running, holding the GPU under whatever ran next)
trap 'kill "${pids[@]}" 2>/dev/null; exit 143' TERM INT
finish() {  # wait for the running groups, print their summaries
  for j in "${!pids[@]}"; do
    local i=${ran[$j]}
    wait "${pids[$j]}" || status=1
    echo "group $i (${groups[$i]}): $(tail -n 1 "$log_dir/group$i.log")"
  done
  pids=(); ran=(); used=()
}
for i in "${!groups[@]}"; do
  [[ -n "${GPU_SUITE_GROUPS:-}" && ",$GPU_SUITE_GROUPS," != *",$i,"* ]] && continue
  gib=${groups[$i]%% *}
  g=${groups[$i]#* }
  files=${g%% -k *}
  args=($files)
  gpu=${gpus[$((i % ${#gpus[@]}))]}
  mib=$(gpu_mib "$gpu"); mib=${mib:-142000}
  if (( (${used[$gpu]:-0} + gib * 1024) * 100 > mib * 83 )); then finish; fi
  used[$gpu]=$(( ${used[$gpu]:-0} + gib * 1024 ))
  frac=$(python -c "print(round(min($gib * 1024 / $mib, 0.83), 3))")
  gpu_env=()
  [[ -n "${GPU_SUITE_GPUS:-}" ]] && gpu_env=(CUDA_VISIBLE_DEVICES=$gpu)
  [[ "$g" == *" -k "* ]] && args+=(-k "${g#* -k }")
  env "${gpu_env[@]}" XLA_PYTHON_CLIENT_MEM_FRACTION=$frac PYTHONUNBUFFERED=1 python -m pytest -m gpu -v -p no:cacheprovider --durations=5 "${args[@]}" >"$log_dir/group$i.log" 2>&1 &
  pids+=($!)
  ran+=($i)
done
finish
echo "logs: $log_dir"
exit $status
