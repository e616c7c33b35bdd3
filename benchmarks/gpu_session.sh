#!/usr/bin/env bash
# The GPU work, in parts a session with a lent GPU runs one per call (the
# device tool allows 10 minutes a command). One session has run so far (H200,
# 2026-11-27, benchmarks/results/gpu-session-h200-2026-11-27.md): the
# self-test took 85 s with the first build of both libraries, the gpu tests
# 103 s with `-n 8`, and the softmax and cross-entropy benches of `kernels`
# ran; `optim`, `models` and `densenet264` have not run, so their durations
# are guesses.
#
#   benchmarks/gpu_session.sh tests     # the kernel self-test, then every @pytest.mark.gpu test
#   benchmarks/gpu_session.sh kernels   # softmax, cross-entropy, reductions (issue 5 targets)
#   benchmarks/gpu_session.sh optim     # ChunkedAdamW vs torch fused at 100M and 1B (issue 6 targets)
#   benchmarks/gpu_session.sh models    # ABN, DenseNet-121 step, effilayers-bench (issues 4, 7)
#   benchmarks/gpu_session.sh densenet264  # DenseNet-264, batch 64, 224x224, bf16 (issue 4 target)
#   benchmarks/gpu_session.sh --list    # print the commands of every part without running them
#
# Results go to $OUT when it is set (the device tool fetches what is there), else
# benchmarks/results, named <family>-<device>-<date>.json as benchmarks/README.md
# asks. The device image has torch, triton, pytest, pytest-benchmark and the
# rest preinstalled and no package registry, so the checkout runs from
# PYTHONPATH instead of being pip-installed.
set -uo pipefail
cd "$(dirname "$0")/.."

part=${1:-}
out=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1

parts=(tests kernels optim models densenet264)
case " ${parts[*]} --list " in
  *" $part "*) ;;
  *) echo "gpu_session.sh: part must be one of: ${parts[*]} (or --list), got '$part'" >&2; exit 2 ;;
esac
if [ "$part" = --list ]; then
  device=DEVICE
else
  # "NVIDIA H100 80GB HBM3" -> h100
  device=$(python3 -c "import torch; assert torch.cuda.is_available(); \
print(torch.cuda.get_device_name().replace('NVIDIA', '').split()[0].split('-')[0].lower())" 2>/dev/null) \
    || { echo "gpu_session.sh: needs a CUDA device" >&2; exit 2; }
fi
date=$(date +%F)
bench_json() { echo "--benchmark-group-by=group --benchmark-json=$out/$1-$device-$date.json"; }

declare -A commands
commands[tests]="python3 -m effilayers.info --selftest
python3 -m pytest -m gpu tests -q -rfEs --timeout=240"
commands[kernels]="python3 -m pytest benchmarks/bench_softmax.py -k cuda $(bench_json softmax) -q
python3 -m pytest benchmarks/bench_cross_entropy.py -k cuda $(bench_json cross_entropy) -q
python3 -m pytest benchmarks/bench_reductions.py -k cuda $(bench_json reductions) -q"
commands[optim]="python3 -m pytest benchmarks/bench_optim.py -k 'cuda and not chunk_size' $(bench_json optim) -q"
commands[models]="python3 -m pytest benchmarks/bench_abn.py -k cuda $(bench_json abn) -q
python3 -m pytest benchmarks/bench_densenet.py -k cuda $(bench_json densenet) -q
python3 -m pytest benchmarks/bench_pooling.py -k cuda $(bench_json pooling) -q
python3 -m effilayers.bench --device cuda --max-batch --json $out/bench-$device-$date.json --plot $out/bench-$device-$date.png"
commands[densenet264]="python3 -m effilayers.bench --device cuda --model densenet264 --batch 64 --size 224 --dtype bfloat16 --steps 3 --json $out/bench-densenet264-bf16-$device-$date.json"

if [ "$part" = --list ]; then
  for name in "${parts[@]}"; do printf '# %s\n%s\n' "$name" "${commands[$name]}"; done
  exit 0
fi

mkdir -p "$out"
status=0
while IFS= read -r command; do
  echo "+ $command"
  bash -c "$command" 2>&1 | tee -a "$out/$part-$device-$date.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done <<< "${commands[$part]}"
exit $status
