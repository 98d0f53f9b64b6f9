#!/usr/bin/env bash
# The GPU benchmark, for a lent CUDA machine that has torch, transformers and CUDA but no registry access.
#
#   tools/gpu_bench.sh fetch   here, where pip reaches PyPI: put the wheels that machine lacks into .whl/
#                              (git-ignored through .git/info/exclude; about 33 MB)
#   tools/gpu_bench.sh [run]   there, from the repo root, with .whl carried: install them into /tmp/site, then
#                              1. tools/bench/gpu.py: FLUX.1 transformer s/step and MFU, eager and regional compile
#                              2. python -m tools.bench --device cuda: runner vs bare loop on the GPU, memory, writer
#                              3. tools/bench/gpu.py --modes offload,taylorseer: staged vs unstaged under offload
#                                 (the transformer's round trip per image vs per shard), TaylorSeer vs none
#                              4. tools/bench/gpu.py --modes full (whole-model compile), if time is left
#   tools/gpu_bench.sh dry     here, without a GPU: the same steps on the CPU at tiny sizes, with .venv's python
#
# With the device tool: run(command="bash tools/gpu_bench.sh", carry=[".whl"], timeout_s=600). It keeps within
# BUDGET_S seconds (default 560) in all; results and logs go to $OUT (default ./gpu-bench-out).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# The project's pins (pyproject.toml) of what the GPU image lacks; it has torch, transformers, accelerate,
# safetensors, tokenizers, huggingface-hub, numpy, pillow, pyarrow, pyyaml and tqdm.
WHEELS=(diffusers==0.42.1 hydra-core==1.3.8 omegaconf==2.3.1 imagecodecs==2026.3.6)
ANTLR=antlr4-python3-runtime==4.9.3 # omegaconf's parser runtime: an sdist only, built into a wheel here
BUDGET_S="${BUDGET_S:-560}"

fetch() {
  local py="${PYTHON:-.venv/bin/python}"
  mkdir -p .git/info .whl
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
  # The GPU image's python3 is CPython 3.12 on x86-64 (see the device docs).
  "$py" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}" || exit 1
  "$py" -m pip wheel --no-deps -w .whl "$ANTLR" || exit 1
  ls -la .whl
}

# Seconds for the next step: at most $1, and never past the budget less $2 seconds kept for what follows.
allow() {
  local left=$((BUDGET_S - SECONDS - ${2:-0}))
  echo $((left < $1 ? left : $1))
}

step() { # step SECONDS LOG COMMAND...: run it under a time limit, its output to the screen and to LOG
  local limit=$1 log=$2
  shift 2
  if ((limit < 30)); then
    echo "skipped (only ${limit}s left): $*" | tee "$log"
    return
  fi
  timeout "$limit" "$@" 2>&1 | tee "$log"
}

run() {
  # The speed part runs on the CPU (tiny model): on the GPU host, gpu.py's offload,taylorseer modes stand for it.
  local out="${OUT:-gpu-bench-out}" py=python3 dev=cuda mfu=() bench=(--images 64 --repeats 2 --parts runner,memory,writer)
  mkdir -p "$out"
  if [[ ${1:-} == dry ]]; then
    py="${PYTHON:-.venv/bin/python}" dev=cpu mfu=(--dry-run)
    bench=(--images 6 --shard-size 2 --repeats 1 --mem-heads 2 --mem-layers 1 --mem-single-layers 1
      --writer-size 256 --writer-images 4 --speed-prompts 4 --offload-shard 4 --cache-images 1 --cache-steps 4)
  else
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl || {
      echo "installing .whl failed: run 'tools/gpu_bench.sh fetch' where PyPI is reachable, and carry .whl"
      exit 1
    }
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$out/gpu.txt"
  fi
  export PYTHONUNBUFFERED=1
  step "$(allow 200 420)" "$out/mfu.log" "$py" -m tools.bench.gpu "${mfu[@]}" --modes eager,regional \
    --out "$out/mfu.json"
  step "$(allow 120 400)" "$out/staged_cache.log" "$py" -m tools.bench.gpu "${mfu[@]}" --modes offload,taylorseer \
    --out "$out/staged_cache.json"
  step "$(allow 280 20)" "$out/bench.log" "$py" -m tools.bench --device "$dev" "${bench[@]}" \
    --writer-processes 1,2,8 --writer-repeats 1 --workdir /tmp --out "$out/bench.json"
  step "$(allow 300 5)" "$out/mfu_full.log" "$py" -m tools.bench.gpu "${mfu[@]}" --modes full \
    --out "$out/mfu_full.json"
  echo "done in ${SECONDS}s; results in $out"
}

case "${1:-run}" in
fetch) fetch ;;
run) run ;;
dry) run dry ;;
*)
  echo "usage: tools/gpu_bench.sh [fetch|run|dry]" >&2
  exit 2
  ;;
esac
