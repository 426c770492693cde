#!/usr/bin/env bash
# The device checks in one call, on a lent GPU machine whose image has torch, Triton and NVML but
# not this project's other dependencies: they travel as wheels in .whl/ (README, Development).
# Nothing here sets a clock, power limit or mode: the clock controller runs in dry-run only.
#   bash bench/gpu_run.sh OUT_DIR [checks|tests|example ...]
set -uo pipefail
out="$1"; shift
parts=("${@:-checks tests example}")
repo="$(cd "$(dirname "$0")/.." && pwd)"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site \
    "$repo"/.whl/*.whl "$repo" >"$out/install.log" 2>&1 || { tail -20 "$out/install.log"; exit 1; }
# The device image's torch (2.11) names two functional collectives by their older names; the project
# pins torch 2.13. A device-only alias (same signatures, same c10d ops), never part of the package:
cat >/tmp/site/sitecustomize.py <<'PY'
import torch.distributed._functional_collectives as funcol
if not hasattr(funcol, "all_gather_single"):
    funcol.all_gather_single = funcol.all_gather_tensor
if not hasattr(funcol, "reduce_scatter_single"):
    funcol.reduce_scatter_single = funcol.reduce_scatter_tensor
PY
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
cd /tmp  # not the repo root: its kareus_fx/ folder would shadow the installed package's mapped subpackages
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu --format=csv | tee "$out/nvidia_smi.csv"
for part in ${parts[*]}; do
    case "$part" in
    checks)
        timeout 300 python3 "$repo/bench/gpu_checks.py" --out "$out/gpu_checks.json" ${CHECKS_ARGS:-} >"$out/gpu_checks.log" 2>&1
        echo "gpu_checks rc=$?"; python3 "$repo/bench/gpu_checks.py" --summary "$out/gpu_checks.json" ;;
    tests)
        t="$repo/tests"
        timeout 200 python3 -m pytest -q -p no:cacheprovider -rs --rootdir "$repo" -c "$repo/pyproject.toml" \
            "$t/test_device_profiler.py::test_gpu_measures_traced_partition" \
            "$t/test_device_profiler.py::test_gpu_replay_times_with_cuda_events" \
            "$t/test_device_profiler.py::test_gpu_measures_from_one_cuda_graph_per_configuration" \
            "$t/test_device_profiler.py::test_gpu_replay_that_cannot_be_captured_is_measured_op_by_op_with_a_warning" \
            "$t/test_runtime.py::test_cuda_stream_table_orders_comm_after_compute" \
            "$t/test_plan_cuda.py::test_gpu_plan_measures_on_device_in_dry_run" \
            "$t/test_distributed_profiling.py::test_the_group_measurer_runs_on_one_gpu_over_nccl_with_an_sm_limited_communicator" \
            "$t/test_clock_guardian.py::test_real_guardian_opens_zeus_and_disarms_without_touching_the_clock" \
            "$t/test_power_limit_guardian.py::test_real_power_limit_guardian_opens_zeus_and_disarms_without_touching_the_limit" \
            >"$out/tests.log" 2>&1
        echo "tests rc=$?"; tail -15 "$out/tests.log" ;;
    example)
        timeout 120 python3 -m kareus_fx.cli plan --model qwen3-1.7b --layers 2 --tp 1 --pp 1 --microbatches 4 \
            --mbs 2 --seq 4096 --gpu h200 --out /tmp/plan-h200 >"$out/example.log" 2>&1 &&
        cp /tmp/plan-h200/plan.json "$out/example_plan.json" &&
        timeout 150 python3 -m torch.distributed.run --nproc-per-node 1 "$repo/examples/train_pipelined.py" \
            --plan /tmp/plan-h200/plan.json --iterations 6 >>"$out/example.log" 2>&1
        echo "example rc=$?"; grep -E "^(iter|summary|plan)" "$out/example.log" | cut -c1-400 ;;
    esac
done
