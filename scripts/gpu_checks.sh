#!/usr/bin/env bash
# The GPU checks of one short run on a CUDA machine, each part under its own time limit, every
# output under $OUT (default ./gpu-out), bundled into one tarball:
#
#   bash scripts/gpu_checks.sh            # at most 9.3 minutes: the parts' limits (380 + 50 + 50 + 75 s)
#                                         # fit one device command (10 minutes)
#
# 1. benchmarks/gpu_suite.py --parts tests ops steps profile: CUDA tests (self-checks, strict
#    kernels), per-op times against torch and Liger, whole training steps against HF sdpa and
#    Liger, where a step's device time goes (the suite's markdown: suite.md)
# 2. benchmarks/launch_host.py: the host µs of one launch, Triton's kernel[grid] against
#    leanact.ops.triton.launch (launch_host.md)
# 3. benchmarks/op_host.py: a lean op's host time per call against torch's (op_host.md)
# 4. benchmarks/norm_programs.py: the norms' kernel time by backward programs per SM (norm_programs.md)
#
# Liger-Kernel, where the machine lacks it: wheels in .whl/ (see the device tool's notes) are
# installed into /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" LEANACT_TRITON=strict
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv >"$out/device.txt" 2>&1
git log -1 --format='%H %cd' >>"$out/device.txt" 2>/dev/null
timeout 380 python3 benchmarks/gpu_suite.py --parts tests ops steps profile --out "$out/suite.md" \
  >"$out/suite.log" 2>&1; echo "gpu_suite exit $?" >>"$out/device.txt"
timeout 50 python3 benchmarks/launch_host.py >"$out/launch_host.md" 2>&1; echo "launch_host exit $?" >>"$out/device.txt"
timeout 50 python3 benchmarks/op_host.py --out "$out/op_host.md" >"$out/op_host.log" 2>&1
echo "op_host exit $?" >>"$out/device.txt"
timeout 75 python3 benchmarks/norm_programs.py >"$out/norm_programs.md" 2>&1
echo "norm_programs exit $?" >>"$out/device.txt"
tar -czf "$out/gpu-checks.tgz" -C "$out" --exclude gpu-checks.tgz . && ls -l "$out"
cat "$out/device.txt"
