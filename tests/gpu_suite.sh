#!/usr/bin/env bash
# The GPU suite (`pytest -m gpu`) on one GPU as five concurrent pytest processes: the suite is
# compile-bound (Mosaic kernels compile for ~25 s each), so the groups overlap their compilation on
# the host's cores while sharing the GPU (each process takes XLA_PYTHON_CLIENT_MEM_FRACTION of its
# memory). Usage: bash tests/gpu_suite.sh [LOG_DIR]; exits non-zero if any group fails, and prints
# each group's summary. Serially, `python -m pytest -m gpu` runs the same tests.
set -u
cd "$(dirname "$0")/.."
log_dir=${1:-$(mktemp -d)}
mkdir -p "$log_dir"
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.18}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
groups=(
  "tests/test_kernels.py -k TestMosaicGPU and (merges or walks_and_streams or dense_index or fully_masked)"
  "tests/test_kernels.py -k TestMosaicGPU and not (merges or walks_and_streams or dense_index or fully_masked)"
  "tests/test_kernels.py tests/test_index_programs.py -k not TestMosaicGPU"
  "tests/test_ring.py tests/test_sparsity_fidelity.py"
  "tests/test_mtraining_attention.py tests/test_bf16_gradients.py"
)
pids=()
for i in "${!groups[@]}"; do
  g=${groups[$i]}
  files=${g%% -k *}
  args=($files)
  [[ "$g" == *" -k "* ]] && args+=(-k "${g#* -k }")
  python -m pytest -m gpu -q -p no:cacheprovider --durations=5 "${args[@]}" >"$log_dir/group$i.log" 2>&1 &
  pids+=($!)
done
status=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || status=1
  echo "group $i (${groups[$i]}): $(tail -n 1 "$log_dir/group$i.log")"
done
echo "logs: $log_dir"
exit $status
