#!/usr/bin/env bash
# Every gpu-marked test in one go, for a lent GPU machine, in under 8 minutes. Made for
# that machine's image (Python 3.12, a CUDA torch, transformers, pytest, pyyaml, psutil;
# no Ray, pydantic or megatron-core): the wheels tests/gpu/wheels.sh put in .whl/ are
# installed first (name .whl in the call's carry), and the trainer checks run their ranks
# as plain processes (torch.distributed, world size 1), no Ray. A test whose needs are
# missing (Ray and SGLang for the RL run, two GPUs and TransformerEngine for Megatron CP)
# is skipped and says why (-rs). The figures come out as one table, also written to
# $TALLY_GPU_TABLE ($OUT/gpu_table.txt on the lent machine).
#   tests/gpu/run.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ -x .venv/bin/python ]; then PYTHON="${PYTHON:-.venv/bin/python}"; else PYTHON="${PYTHON:-python3}"; fi
WHEELS="${WHEELS:-.whl}"
# The carried wheels, where the interpreter lacks what they hold (a dev venv has them all).
if compgen -G "$WHEELS/*.whl" >/dev/null && ! "$PYTHON" -c "import pydantic, megatron.core" 2>/dev/null; then
    SITE="${TALLY_GPU_SITE:-/tmp/tally-gpu-site}"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$WHEELS"/*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export RAY_ADDRESS=local  # where Ray is installed: a fresh local head, never another cluster
if [ -n "${OUT:-}" ]; then export TALLY_GPU_TABLE="${TALLY_GPU_TABLE:-$OUT/gpu_table.txt}"; fi
"$PYTHON" - <<'PY'
import torch
if torch.cuda.is_available():
    print(f"torch {torch.__version__}, {torch.cuda.device_count()} GPU(s): "
          f"{torch.cuda.get_device_name(0)}")
else:
    print(f"torch {torch.__version__}: no CUDA GPU visible; the one-GPU checks run on the "
          f"CPU only with TALLY_GPU_CHECKS_ON=cpu")
PY
exec timeout --signal=INT --kill-after=20 470 \
    "$PYTHON" -m pytest -m gpu -q -rs -p no:cacheprovider tests/gpu "$@"
