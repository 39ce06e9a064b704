#!/usr/bin/env bash
# The GPU checks, as one short run on a lent accelerator machine (no network there):
# the tests that need CUDA, the guard's overhead table on the GPU, and (4+ GPUs) the cost of
# check_replicas on an HSDP mesh over NCCL.
#
# Prepare here (the device image has torch, pytest and xxhash, not blake3):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_17_x86_64 -d .whl blake3
# then run `bash benchmarks/gpu_check.sh` there with `.whl` carried. Logs and
# docs/benchmarks/guard-cuda.md land in $OUT (default /tmp/torchverity-gpu).
set -uo pipefail
out=${OUT:-/tmp/torchverity-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/tv-site .whl/*.whl || exit 2
    export PYTHONPATH=$PYTHONPATH:/tmp/tv-site
fi
python3 - <<'EOF' || exit 2
import sys
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, devices {torch.cuda.device_count()}")
if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device here; run it on the lent GPU machine")
print(torch.cuda.get_device_name(0))
EOF
status=0
# The guard's tests (the one that needs CUDA: the hot path never synchronises) and the
# fingerprint tests.
python3 -m pytest -q -p no:cacheprovider -x tests/training/test_guard_policies.py \
    tests/training/test_guard_fused.py tests/checkpoint/test_fingerprint.py \
    2>&1 | tee "$out/tests-cuda.log" || status=1
# Every window verified: the fused guard against torch.compile(optimizer.step), the
# two-pass guard against the eager step, on the GPU (each block ends with a sync).
timeout 420 python3 benchmarks/bench_guard.py --device cuda --rounds 6 2>&1 \
    | tee "$out/bench-guard-cuda.log" || status=1
cp docs/benchmarks/guard-cuda.md "$out/" 2>/dev/null || status=1
# Planned (not run yet): check_replicas on a 2x2 HSDP mesh over NCCL, per call and amortised
# at 1 check / 100 steps next to the FSDP2 step; needs 4 GPUs (one rank per GPU).
if python3 -c "import torch, sys; sys.exit(torch.cuda.device_count() < 4)"; then
    timeout 420 python3 benchmarks/bench_distributed.py --hsdp --quick --device cuda 2>&1 \
        | tee "$out/bench-distributed-hsdp-cuda.log" || status=1
    cp docs/benchmarks/distributed-hsdp-cuda.md "$out/" 2>/dev/null || status=1
else
    echo "bench_distributed --hsdp --device cuda: skipped, needs 4 GPUs for NCCL" \
        | tee "$out/bench-distributed-hsdp-cuda.log"
fi
exit $status
