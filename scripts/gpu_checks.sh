#!/usr/bin/env bash
# The GPU checks of one short run on a CUDA machine, each part under its own time limit, every
# output under $OUT (default ./gpu-out), bundled into one tarball:
#
#   bash scripts/gpu_checks.sh            # at most 9.5 minutes: the parts' limits (330 + 40 + 50 + 150 s)
#                                         # fit one device command (10 minutes)
#   SUITE_PARTS="ops steps bert" SUITE_S=260 LAUNCH_S=0 bash scripts/gpu_checks.sh   # other suite parts;
#                                         # a part's limit of 0 skips it
#
# 1. benchmarks/gpu_suite --parts $SUITE_PARTS (default: tests ops steps profile): CUDA tests
#    (self-checks, strict kernels), per-op times against torch and Liger, whole training steps
#    against HF sdpa and Liger, where a step's device time goes (the suite's markdown: suite.md)
# 2. benchmarks/launch_host.py: the host µs of one launch, Triton's kernel[grid] against
#    leanact.ops.triton.launch (launch_host.md)
# 3. benchmarks/op_host.py: a lean op's host time per call against torch's (op_host.md)
# 4. benchmarks/gelu_directions.py: the float32 GELU kernels per direction and by table-row read,
#    launch shape and backward quotient, against torch's (gelu_directions.md)
# 5. benchmarks/norm_programs.py: the norms' kernel time by backward programs (norm_programs.md; off
#    by default: PROGRAMS_PER_SM came from it; NORM_S=120 runs it)
#
# Limits in seconds: SUITE_S (330), LAUNCH_S (40), OPHOST_S (50), GELU_S (150), NORM_S (0).
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
parts=${SUITE_PARTS:-tests ops steps profile}
# part NAME LIMIT COMMAND...: COMMAND under LIMIT seconds (0: skipped), its exit status noted
part() {
  local name=$1 limit=$2; shift 2
  if [ "$limit" -gt 0 ]; then
    timeout "$limit" "$@"; echo "$name exit $?" >>"$out/device.txt"
  else
    echo "$name skipped" >>"$out/device.txt"
  fi
}
# shellcheck disable=SC2086  # $parts: one word per part
part gpu_suite "${SUITE_S:-330}" python3 benchmarks/gpu_suite --parts $parts --out "$out/suite.md" \
  >"$out/suite.log" 2>&1
part launch_host "${LAUNCH_S:-40}" python3 benchmarks/launch_host.py >"$out/launch_host.md" 2>&1
part op_host "${OPHOST_S:-50}" python3 benchmarks/op_host.py --out "$out/op_host.md" >"$out/op_host.log" 2>&1
part gelu_directions "${GELU_S:-150}" python3 benchmarks/gelu_directions.py --out "$out/gelu_directions.md" \
  >"$out/gelu_directions.log" 2>&1
part norm_programs "${NORM_S:-0}" python3 benchmarks/norm_programs.py >"$out/norm_programs.md" 2>&1
tgz=$(mktemp) && tar -czf "$tgz" -C "$out" --exclude gpu-checks.tgz . && mv "$tgz" "$out/gpu-checks.tgz" && ls -l "$out"
cat "$out/device.txt"
