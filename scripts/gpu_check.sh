#!/usr/bin/env bash
# The GPU check (issue 30 item 6): every codec on CUDA against the CPU result and a device
# copy, then training on CUDA through the CLI (one process per GPU; NCCL with two GPUs).
# Runs on one GPU in under 8 minutes. Usage: scripts/gpu_check.sh  (from the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
make venv >/dev/null
.venv/bin/python - <<'PY'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPUs: {torch.cuda.device_count()}",
      *(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())), sep="\n  ")
PY
exec timeout 480 .venv/bin/python -m pytest -q -rs --durations=10 tests/gpu "$@"
