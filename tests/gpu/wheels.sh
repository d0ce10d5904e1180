#!/usr/bin/env bash
# The packages the lent GPU machine lacks (Python 3.12, torch 2.11, transformers, pytest,
# pyyaml, psutil are there; pydantic and megatron-core are not), as wheels in .whl/
# (git-ignored), at the versions requirements/cpu.txt pins. Run here, then name .whl in
# the device call's carry; tests/gpu/run.sh installs them there.
#   [WHEELS=folder] tests/gpu/wheels.sh [python-version, default 3.12]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY_VERSION="${1:-3.12}"
pin() { grep -i "^$1==" requirements/cpu.txt | cut -d= -f3; }
WHEELS="${WHEELS:-.whl}"
mkdir -p "$WHEELS"
for spec in "pydantic==$(pin pydantic)" "pydantic-core==2.50.5" "annotated-types==0.8.0" \
            "typing-inspection==0.4.5" "typing-extensions==4.16.0" \
            "megatron-core==$(pin megatron-core)"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d "$WHEELS" "$spec"
done
ls -l "$WHEELS"
