#!/usr/bin/env bash
# The whole device check as one command, on a machine with a CUDA GPU and a python3 that has a CUDA
# torch, safetensors, pytest, pytest-timeout and hypothesis: tests/gpu, then the accelerator benchmarks
# (loads: cuda_bench.py; saves and dcp.async_save: cuda_save_bench.py; registering mapped pages:
# cuda_register_bench.py). Logs and JSON go to $OUT (default ./gpu_out). Exits non-zero if any fails.
# Sized for about 8 minutes in all on an H100/H200 host (each step has its own timeout).
#
#     bash benchmarks/gpu_check.sh                  # SIZE=2GB REPEATS=3 by default
#     SIZE=8GB REPEATS=2 FILL=none STAGING=none bash benchmarks/gpu_check.sh   # FILL/STAGING: the sweeps
#     ONLY=bench bash benchmarks/gpu_check.sh       # skip tests/gpu (ONLY=tests: skip the benchmarks)
set -u
cd "$(dirname "$0")/.."
out=${OUT:-gpu_out}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then  # optional peers carried as wheels (fastsafetensors)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  python3 -c "import sys, torch, safetensors; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'safetensors', safetensors.__version__, 'gpus', torch.cuda.device_count())"
  nproc; free -g | head -2; df -h . | tail -1; uname -a
} 2>&1 | tee "$out/env.txt"

set -o pipefail
only=${ONLY:-all}
tests=0 bench=0 save=0 register=0
if [ "$only" != bench ]; then
  timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider -rs tests/gpu 2>&1 | tee "$out/gpu_tests.log"
  tests=$?
fi
if [ "$only" != tests ]; then
  timeout "${BENCH_TIMEOUT:-240}" python3 benchmarks/cuda_bench.py --size "${SIZE:-2GB}" --repeats "${REPEATS:-3}" \
    --fill-threads "${FILL:-1,8}" --staging "${STAGING:-3x32MiB,4x32MiB,6x16MiB,4x64MiB}" \
    --out "$out/cuda_bench.json" 2>&1 | tee "$out/cuda_bench.log"
  bench=$?
  timeout "${SAVE_TIMEOUT:-100}" python3 benchmarks/cuda_save_bench.py --size "${SIZE:-2GB}" --repeats "${REPEATS:-3}" \
    --out "$out/cuda_save_bench.json" 2>&1 | tee "$out/cuda_save_bench.log"
  save=$?
  timeout "${REGISTER_TIMEOUT:-80}" python3 benchmarks/cuda_register_bench.py --size "${SIZE:-2GB}" \
    --repeats "${REPEATS:-3}" --out "$out/cuda_register_bench.json" 2>&1 | tee "$out/cuda_register_bench.log"
  register=$?
fi
echo "gpu_check: tests exit $tests, cuda_bench exit $bench, cuda_save_bench exit $save, cuda_register_bench exit $register"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ] && [ "$save" -eq 0 ] && [ "$register" -eq 0 ]
