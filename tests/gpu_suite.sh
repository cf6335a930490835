#!/usr/bin/env bash
# The GPU suite (`pytest -m gpu`) on one GPU as five concurrent pytest processes: the suite is
# compile-bound (Mosaic kernels compile for ~25 s each), so the groups overlap their compilation on
# the host's cores while sharing the GPU: each group takes its share of the GPU's memory (the first
# number of its entry; XLA_PYTHON_CLIENT_MEM_FRACTION), the shares summing to 0.83: the rest is for what
# each process allocates outside XLA's pool (CUDA graphs, cuBLAS handles, Mosaic modules; shares
# summing to 0.98 ran out there on 2026-11-28). XLA's autotuner is off (its profiling buffers for the
# float32 references at 16K ran out of memory at a 0.18 share); it picks configurations, not results.
# Usage: bash tests/gpu_suite.sh [LOG_DIR] (GPU_SUITE_GROUPS=0,1 runs only those groups;
# GPU_SUITE_GPUS=0,1,2,3 spreads the groups over those GPUs, group i on the (i mod n)-th, each
# group's share then of its own GPU); exits non-zero if any group fails, and prints each group's
# summary. Serially, `python -m pytest -m gpu` runs the same tests.
set -u
cd "$(dirname "$0")/.."
log_dir=${1:-$(mktemp -d)}
mkdir -p "$log_dir"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0"
groups=(
  "0.22 tests/test_kernels.py -k TestMosaicGPU and (merges or walks_and_streams or dense_index or fully_masked)"
  "0.22 tests/test_kernels.py -k TestMosaicGPU and not (merges or walks_and_streams or dense_index or fully_masked)"
  "0.13 tests/test_kernels.py tests/test_index_programs.py tests/test_window_scores.py -k not TestMosaicGPU"
  "0.13 tests/test_ring.py tests/test_sparsity_fidelity.py"
  "0.13 tests/test_mtraining_attention.py tests/test_bf16_gradients.py"
)
pids=()
ran=()
for i in "${!groups[@]}"; do
  [[ -n "${GPU_SUITE_GROUPS:-}" && ",$GPU_SUITE_GROUPS," != *",$i,"* ]] && continue
  ran+=($i)
  frac=${groups[$i]%% *}
  g=${groups[$i]#* }
  files=${g%% -k *}
  args=($files)
  gpu_env=()
  if [[ -n "${GPU_SUITE_GPUS:-}" ]]; then
    IFS=, read -r -a gpus <<<"$GPU_SUITE_GPUS"
    gpu_env=(CUDA_VISIBLE_DEVICES=${gpus[$((i % ${#gpus[@]}))]})
  fi
  [[ "$g" == *" -k "* ]] && args+=(-k "${g#* -k }")
  env "${gpu_env[@]}" XLA_PYTHON_CLIENT_MEM_FRACTION=$frac python -m pytest -m gpu -q -p no:cacheprovider --durations=5 "${args[@]}" >"$log_dir/group$i.log" 2>&1 &
  pids+=($!)
done
status=0
for j in "${!pids[@]}"; do
  i=${ran[$j]}
  wait "${pids[$j]}" || status=1
  echo "group $i (${groups[$i]}): $(tail -n 1 "$log_dir/group$i.log")"
done
echo "logs: $log_dir"
exit $status
