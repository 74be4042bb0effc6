#!/usr/bin/env bash
# The engine on a GPU, from a bare machine: PyTorch, transformers, nanobind, scikit-build-core, pyarrow, rich,
# typer, matplotlib; no network, no model weights (every model is randomly initialised).
#
#   scripts/gpu-check.sh                      # CUDA: ladder, calibration (Qwen2.5-1.5B/7B shapes), what-if
#   scripts/gpu-check.sh --device cpu --tiny  # the same path on CPU with tiny shapes (tests/lab/test_gpu_check.py)
#
# Builds the native core if `import dasrl._core` fails (pip editable install; without cmake, a direct
# compile with nanobind's sources), then runs `python -m dasrl_lab.bench.gpu` (= `dasrl bench gpu`) with the
# arguments given. Results: $OUT/gpu-check.json when OUT is set (or --json PATH); a log beside it.
# Exit status: 0 when every part ran and the fp32 ladder is exact, 1 otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1

build_cc() {  # the native core without cmake: nanobind's combined source + ours, one compiler call
  local out=${DASRL_CORE_OUT:-dasrl}
  local nb inc suffix
  nb=$("$PY" -c "import nanobind; print(nanobind.source_dir())")
  inc=$("$PY" -c "import nanobind; print(nanobind.include_dir())")
  suffix=$("$PY" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
  "${CXX:-c++}" -O3 -std=c++17 -shared -fPIC -fvisibility=hidden -DNDEBUG -DNB_COMPACT_ASSERTIONS \
    -I"$inc" -I"$nb/../ext/robin_map/include" -I"$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")" \
    "$nb/nb_combined.cpp" src/core/suffix_index.cpp src/core/bindings.cpp -o "$out/_core$suffix"
}

if [ "${1:-}" = "--build-cc-only" ]; then build_cc; exit 0; fi  # (tests: the fallback compile on its own)

if ! "$PY" -c "import dasrl._core" 2>/dev/null; then
  echo "building the native core" >&2
  if ! timeout 300 "$PY" -m pip install -q --no-build-isolation --no-deps -e . >&2 \
      || ! "$PY" -c "import dasrl._core" 2>/dev/null; then
    echo "pip editable install did not give dasrl._core; compiling it directly" >&2
    build_cc
  fi
  "$PY" -c "import dasrl._core" || { echo "dasrl._core does not import after the build" >&2; exit 1; }
fi

if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  "$PY" -m dasrl_lab.bench.gpu "$@" 2>&1 | tee "$OUT/gpu-check.log"
  exit "${PIPESTATUS[0]}"
fi
exec "$PY" -m dasrl_lab.bench.gpu "$@"
