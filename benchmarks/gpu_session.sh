#!/usr/bin/env bash
# The GPU validation in one command (benchmarks/gpu_session.py says what it
# runs and how; benchmarks/README.md gives the device call):
#
#   benchmarks/gpu_session.sh prebuild .gpu-prebuilt   # here: torch 2.11+cu130, Triton 3.6
#   benchmarks/gpu_session.sh all                      # on the GPU machine, <= 540 s
#   benchmarks/gpu_session.sh all --dry-run            # the plan: one line per step
#   benchmarks/gpu_session.sh tests fit                # some steps again
#
# The device image has torch, Triton, pytest and pytest-benchmark and no
# package registry, so the checkout runs from PYTHONPATH. PYTHON picks the
# interpreter (prebuild needs the one with the GPU image's torch).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" benchmarks/gpu_session.py "$@"
