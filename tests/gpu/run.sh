#!/usr/bin/env bash
# Every gpu-marked test in one go, for a lent GPU machine; the whole run is capped at
# 10 minutes. Needs a CUDA torch and, per test, megatron-core + TransformerEngine (CP) and
# sglang (RL run); a test whose needs are missing is skipped and says why (-rs).
#   tests/gpu/run.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-.venv/bin/python}"
export RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export RAY_ADDRESS=local  # a fresh local Ray head, never someone else's cluster
"$PYTHON" - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA GPU visible to torch"
print(f"{torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}")
PY
exec timeout --signal=INT --kill-after=20 580 \
    "$PYTHON" -m pytest -m gpu -q -rs -p no:cacheprovider tests "$@"
