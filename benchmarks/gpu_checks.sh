#!/usr/bin/env bash
# The checks a GPU machine (no network, CUDA torch already installed, Python 3.12) runs, in one call.
#
#   bash benchmarks/gpu_checks.sh pack   # here, on the machine with network: writes .whl/site.tar.xz (about 40 MB)
#   bash benchmarks/gpu_checks.sh run    # there, with .whl carried: unpacks, then runs the checks into $OUT
#
# pack: what the project imports and the GPU machine lacks (benchmarks/wheelhouse.py: for its Python 3.12, less the
# packages its image holds, benchmarks/gpu_image_packages.txt), installed into one folder and cut down to what importing
# them needs. Left out: ManiSkill's meshes and textures (its asset metadata stays: mani_skill reads it on import),
# SAPIEN's C++ headers and sensor patterns, and jedi's typeshed copy. No ManiSkill scene can be built from it; the
# PhysX GPU library (physx_cuda) is not in any wheel: SAPIEN downloads it from GitHub on first use.
#
# run: in one call of at most 9 minutes, each step under its own time limit (seconds, env vars):
#   T_GRAPHS (120) ppo_staggered's --cudagraphs equality test, first and on its own, so that it completes
#   T_TESTS (180)  every other CUDA test case (pytest -k cuda) except those that simulate ManiSkill on the GPU
#   T_SCALE (180)  benchmarks/speed.py --scaling 512 4096 32768: ppo_staggered on ToyChain (K = 5), training steps/s
#                  on the CPU vs eager CUDA vs --cudagraphs, side by side (speed_scaling_{gpu}_{date}.md/json)
#   T_VER (90)     benchmarks/ver_throughput.py --experiment gpu at one spread level
#   then, with what is left of BUDGET (520): benchmarks/toy_sweeps.py --experiment scaling on CUDA with --cudagraphs
#                  up to N = 131,072, 2 seeds, seed by seed (toy_scaling_{gpu}_{date}.md/json/png; a stop keeps what ran)
# Logs go to $OUT (env.log, cuda_tests.log, benchmarks.log) and results to $OUT/bench.tar: at most 8 files come back.
set -uo pipefail
cd "$(dirname "$0")/.."

pack() {
  local site
  site=$(mktemp -d)
  mkdir -p .whl
  python3 benchmarks/wheelhouse.py --site "$site" --python-version 3.12 || return 1
  find "$site/mani_skill/assets" -type f -size +300k -delete
  find "$site/mani_skill/assets" -type f \( -name '*.glb' -o -name '*.obj' -o -name '*.stl' -o -name '*.STL' \
    -o -name '*.dae' -o -name '*.png' -o -name '*.ply' \) -delete
  find "$site/mani_skill/utils/scene_builder" -type f ! -name '*.py' -size +200k -delete
  rm -rf "$site/jedi/third_party" "$site/sapien/include" "$site/sapien/sensor/assets"
  tar -C "$site" -cf - . | xz -T0 -3 >.whl/site.tar.xz
  rm -rf "$site"
  local exclude
  exclude=$(git rev-parse --git-path info/exclude) && mkdir -p "$(dirname "$exclude")"
  grep -qsx '/.whl/' "$exclude" || echo /.whl/ >>"$exclude"
  ls -la .whl/site.tar.xz
}

run() {
  local t0=$SECONDS
  mkdir -p /tmp/site && tar -C /tmp/site -xJf .whl/site.tar.xz || return 1
  export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
  {
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import torch, tensordict, mani_skill.envs; print(torch.__version__, torch.cuda.get_device_name(0))"
    PYTHONPATH= python3 -m pip freeze  # what the image holds: benchmarks/gpu_image_packages.txt
  } 2>&1 | tee "$OUT/env.log"
  timeout "${T_GRAPHS:-120}" python3 -m pytest tests/test_ppo_staggered.py -q -rs -p no:cacheprovider --durations=0 \
    -k "cudagraphs" 2>&1 | tee -a "$OUT/cuda_tests.log"
  echo "cudagraphs test done at $((SECONDS - t0)) s"
  timeout "${T_TESTS:-180}" python3 -m pytest tests -q -rs -p no:cacheprovider --durations=0 \
    -k "cuda and not cudagraphs and not stackcube_preset and not simulation_runs_on" 2>&1 | tee -a "$OUT/cuda_tests.log"
  echo "tests done at $((SECONDS - t0)) s"
  local bench=/tmp/bench log="$OUT/benchmarks.log"
  mkdir -p "$bench"
  timeout "${T_SCALE:-180}" python3 benchmarks/speed.py --scaling 512 4096 32768 --iterations 12 \
    --output "$bench" 2>&1 | tee "$log"
  tar -C /tmp -cf "$OUT/bench.tar" bench
  echo "speed done at $((SECONDS - t0)) s" | tee -a "$log"
  timeout "${T_VER:-90}" python3 benchmarks/ver_throughput.py --experiment gpu --spreads 1.5 --repeats 1 \
    --gpu-ranks 2 --output "$bench" 2>&1 | tee -a "$log"
  tar -C /tmp -cf "$OUT/bench.tar" bench
  echo "ver_throughput done at $((SECONDS - t0)) s" | tee -a "$log"
  local left=$((${BUDGET:-520} - (SECONDS - t0)))
  if [ "$left" -ge 60 ]; then
    timeout "$left" python3 benchmarks/toy_sweeps.py --experiment scaling --device cuda --cudagraphs --workers 1 \
      --seeds 2 --num-envs 131072 32768 8192 2048 512 --output "$bench" 2>&1 | tee -a "$log"
  else
    echo "toy scaling sweep skipped: ${left} s left" | tee -a "$log"
  fi
  tar -C /tmp -cf "$OUT/bench.tar" bench
  echo "all done at $((SECONDS - t0)) s" | tee -a "$log"
}

case "${1:-}" in
  pack) pack ;;
  run) run ;;
  *) echo "usage: bash benchmarks/gpu_checks.sh pack|run" >&2; exit 2 ;;
esac
