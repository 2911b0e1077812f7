#!/usr/bin/env bash
# The whole device check as one command, on a machine with a CUDA GPU and a python3 that has a CUDA
# torch, safetensors, pytest, pytest-timeout and hypothesis: tests/gpu, then benchmarks/cuda_bench.py.
# Logs and the benchmark's JSON go to $OUT (default ./gpu_out). Exits non-zero if either fails.
#
#     bash benchmarks/gpu_check.sh                  # SIZE=2GB REPEATS=3 by default
#     SIZE=8GB REPEATS=2 FILL=none bash benchmarks/gpu_check.sh   # FILL: the fill-thread sweep
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
timeout "${TEST_TIMEOUT:-270}" python3 -m pytest -q -p no:cacheprovider -rs tests/gpu 2>&1 | tee "$out/gpu_tests.log"
tests=$?
timeout "${BENCH_TIMEOUT:-270}" python3 benchmarks/cuda_bench.py --size "${SIZE:-2GB}" --repeats "${REPEATS:-3}" \
  --fill-threads "${FILL:-1,4,8,16}" --out "$out/cuda_bench.json" 2>&1 | tee "$out/cuda_bench.log"
bench=$?
echo "gpu_check: tests exit $tests, cuda_bench exit $bench"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
