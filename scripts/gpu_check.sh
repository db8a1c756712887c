#!/usr/bin/env bash
# The GPU check of the GPU path (docs/gpu.md), in two parts:
#
#   scripts/gpu_check.sh prepare   where PyPI is reachable (the dev machine): writes .gpu/
#                                  (git-ignored, ~56 MB) with what a GPU machine without
#                                  network lacks: numpy<2 (the Triton stub breaks on numpy 2),
#                                  the pinned transformers, and tritonserver 2.51 from the pinned
#                                  nvidia-pytriton wheel, cut to one Python's stub
#                                  (GPU_PYTHON, default 3.12: the GPU machine's python3).
#   scripts/gpu_check.sh           on the GPU machine, from the repository root, with .gpu/:
#                                  about 3-5 minutes on an H200, always under 9.
#   scripts/gpu_check.sh tests     the same, the tests alone (about 2.5 minutes on an H200);
#   scripts/gpu_check.sh speed     the speed comparison alone (about a minute).
#
# The GPU machine must have: an NVIDIA GPU, a python3 with a CUDA build of torch and triton
# (plus tokenizers, safetensors, huggingface_hub, pytest, pytest-timeout), a C compiler for
# Triton's launcher, and, for the server tests only, libpython<version>.so of that python
# (the Triton stub links it; without it they are reported as not run). The run builds a venv
# in /tmp over that python's packages with .gpu/'s packages first, then runs
#   1. tests/unit/test_device.py (TargetRunner and every model-based proposer on cuda vs cpu),
#      tests/e2e/test_device_server.py (the real server with KIND_GPU verifier and drafter:
#      greedy == HF greedy), tests/unit/test_rejection_kernels.py, tests/unit/test_ngram_gpu.py and
#      tests/unit/test_gpu_kernels.py (the OpenAI Triton kernels compiled on CUDA vs their torch
#      references; the batch-invariant lean runtime on them: bit-identical logits whatever
#      shares a step, bf16 speculative output == plain output);
#   2. scripts/gpu_speed.py (CPU vs CUDA: verify step, transformers and batch-invariant,
#      drafting, rejection sampling);
# and prints a summary. Logs and results go to $OUT (or /tmp/gpu-check).
# GPU_DIR (default .gpu) names the folder in both parts.
set -uo pipefail
cd "$(dirname "$0")/.."
GPU_DIR=${GPU_DIR:-.gpu}

pin() {  # the pinned version of a dependency in pyproject.toml
    sed -n "s/^ *\"$1==\([^\"]*\)\".*/\1/p" pyproject.toml
}

prepare() {
    local pyv=${GPU_PYTHON:-3.12} python=${PYTHON:-.venv/bin/python} tmp exclude numpy
    tmp=$(mktemp -d)
    rm -rf "$GPU_DIR" && mkdir -p "$GPU_DIR/wheels"
    exclude=$(git rev-parse --git-path info/exclude)
    grep -qx "/$GPU_DIR/" "$exclude" 2>/dev/null || echo "/$GPU_DIR/" >>"$exclude"
    numpy=$("$python" -c 'import numpy; print(numpy.__version__)')  # the dev venv's numpy<2
    local download=("$python" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyv"
                    --implementation cp --platform manylinux_2_35_x86_64 --platform manylinux_2_17_x86_64
                    --platform manylinux2014_x86_64)
    "${download[@]}" -d "$GPU_DIR/wheels" "numpy==$numpy" "transformers==$(pin transformers)" || exit 1
    "${download[@]}" -d "$tmp" "nvidia-pytriton==$(pin nvidia-pytriton)" || exit 1
    # tritonserver, the Python backend, this Python's stub and their libraries; not the
    # pytriton library itself (the launcher only needs the files) nor the other stubs.
    (cd "$tmp" && unzip -q nvidia_pytriton-*.whl 'pytriton/__init__.py' 'pytriton/tritonserver/bin/*' \
        'pytriton/tritonserver/backends/*' 'pytriton/tritonserver/caches/*' \
        "pytriton/tritonserver/python_backend_stubs/$pyv/*" 'nvidia_pytriton.libs/*' \
        -x 'nvidia_pytriton.libs/libpython3*' -d payload) || exit 1
    echo "compressing tritonserver (a minute or two)..."
    tar -C "$tmp/payload" -cf - . | xz -T0 -6 >"$GPU_DIR/tritonserver.tar.xz" || exit 1
    echo "$pyv" >"$GPU_DIR/PYTHON_VERSION"
    rm -rf "$tmp"
    du -sh "$GPU_DIR"
    echo "now, on the GPU machine: bash scripts/gpu_check.sh   (with $GPU_DIR carried along)"
}

if [ "${1:-}" = prepare ]; then
    prepare
    exit
fi

OUTDIR=${OUT:-/tmp/gpu-check}
mkdir -p "$OUTDIR"
PY=${PYTHON:-python3}
STARTED=$(date +%s)
say() { echo "== $*"; }

say "machine"
nvidia-smi -L || { echo "no NVIDIA GPU here"; exit 1; }
"$PY" -c 'import sys, torch, triton; print("python", sys.version.split()[0], "| torch", torch.__version__,
"| triton", triton.__version__, "| cuda", torch.cuda.is_available())
sys.exit(0 if torch.cuda.is_available() else 1)' || { echo "this python's torch has no CUDA"; exit 1; }

say "environment"
[ -f "$GPU_DIR/PYTHON_VERSION" ] || {
    echo "$GPU_DIR/ is missing: run 'scripts/gpu_check.sh prepare' where PyPI is reachable, and carry $GPU_DIR"
    exit 1
}
PYV=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ "$PYV" = "$(cat "$GPU_DIR/PYTHON_VERSION")" ] || {
    echo "$GPU_DIR/ is for Python $(cat "$GPU_DIR/PYTHON_VERSION"), this machine has $PYV: GPU_PYTHON=$PYV scripts/gpu_check.sh prepare"
    exit 1
}
VENV=/tmp/tritonspec-gpu-venv
rm -rf "$VENV"
"$PY" -m venv --without-pip "$VENV" || exit 1
VPY=$VENV/bin/python3
VSITE=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$VSITE" "$GPU_DIR"/wheels/*.whl || exit 1
tar -xJf "$GPU_DIR/tritonserver.tar.xz" -C "$VSITE" || exit 1
# After the venv's own packages (numpy<2, transformers, tritonserver): the machine's torch
# environment (its .pth files too), then this checkout (what `pip install -e` would add).
# The Triton stub embeds this venv's python (the launcher puts its bin/ first on PATH).
TORCH_SITE=$("$PY" -c 'import pathlib, torch; print(pathlib.Path(torch.__file__).parents[1])')
# The image's scipy (and what needs it) is built for numpy 2, and transformers imports scipy
# whenever it is installed: the venv hides them (the project needs neither).
printf 'import site; site.addsitedir("%s")\n%s\nimport sys; sys.modules.update(dict.fromkeys(("scipy", "sklearn"), None))\n' \
    "$TORCH_SITE" "$PWD" >"$VSITE/zz_tritonspec_gpu.pth"
"$VPY" -c 'import numpy, torch, transformers; print("venv: numpy", numpy.__version__, "| transformers",
transformers.__version__, "| torch", torch.__version__)' || exit 1

SERVER=1
STUB=$VSITE/pytriton/tritonserver/python_backend_stubs/$PYV/triton_python_backend_stub
LIBDIR=$("$VPY" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR") or "")')
MISSING=$(LD_LIBRARY_PATH=$LIBDIR ldd "$STUB" | grep 'not found')
if [ -n "$MISSING" ]; then
    SERVER=0
    echo "SERVER TESTS NOT RUN: the Triton Python stub cannot load here: $MISSING"
fi

export PYTHONUNBUFFERED=1 TRITONSPEC_CACHE=/tmp/tritonspec-cache
TESTS=0
if [ "${1:-}" != speed ]; then  # `scripts/gpu_check.sh speed`: the speed comparison alone
    say "GPU tests"
    SELECT=()
    [ "$SERVER" = 1 ] || SELECT=(-m "not e2e")
    timeout 330 "$VPY" -m pytest -q -rs -p no:cacheprovider tests/unit/test_device.py tests/e2e/test_device_server.py \
        tests/unit/test_rejection_kernels.py tests/unit/test_ngram_gpu.py tests/unit/test_gpu_kernels.py "${SELECT[@]}" \
        --junitxml "$OUTDIR/gpu_tests.xml" 2>&1 | tee "$OUTDIR/gpu_tests.log"
    TESTS=${PIPESTATUS[0]}
fi

SPEED=0
if [ "${1:-}" != tests ]; then  # `scripts/gpu_check.sh tests`: the tests alone
    say "speed (CPU vs CUDA)"
    timeout 170 "$VPY" scripts/gpu_speed.py --profile --out "$OUTDIR/gpu_speed.json" 2>&1 | tee "$OUTDIR/gpu_speed.log"
    SPEED=${PIPESTATUS[0]}
fi

say "summary"
[ "${1:-}" = speed ] || echo "tests: $(grep -E '(passed|failed|error)' "$OUTDIR/gpu_tests.log" | tail -1) (exit $TESTS)"
[ "$SERVER" = 1 ] || echo "server tests: NOT RUN (see above)"
[ "${1:-}" = tests ] || echo "speed: exit $SPEED; table above, $OUTDIR/gpu_speed.json"
echo "took $(($(date +%s) - STARTED)) s"
[ "$TESTS" = 0 ] && [ "$SPEED" = 0 ]
