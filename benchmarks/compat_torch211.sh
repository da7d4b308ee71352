#!/usr/bin/env bash
# The test suite under the GPU machine's software on this CPU: torch 2.11 (the GPU image's release, 2.13 is the
# project's), torchao 0.18.0, Python 3.12, and only the packages that image has plus the wheels sent to it, run
# uninstalled from the checkout with PYTHONPATH, as there. A failure here would otherwise first show on the GPU.
#
#   bash benchmarks/compat_torch211.sh                    # the whole suite (about 5 min on 2 busy cores)
#   bash benchmarks/compat_torch211.sh tests/test_api.py  # arguments go to pytest
#   bash benchmarks/compat_torch211.sh --extras [...]     # also the test extra's tools (transformers, Lightning,
#                                                         # Megatron-core, ...) in .venv211-extras
#
# The environment lives in .venv211/ (or .venv211-extras/) at the project root (git-ignored) and is reused.
# Its first setup downloads about 4 GB and takes a few minutes: PyPI's Linux torch is the CUDA build, whose
# libtorch_cuda.so needs cuDNN, cuBLAS, NCCL, ... to import at all, even on a CPU (torch installed with
# --no-deps fails: libcudnn.so.9 not found), so pip brings the nvidia-* wheels as well; nothing loads a GPU.
# PYTHON picks the interpreter (default python3.12, the GPU image's; else python3); TORCH and TORCHAO the pair.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH=${TORCH:-2.11.0}
TORCHAO=${TORCHAO:-0.18.0}  # torchao 0.18 needs torch >= 2.11; the newest torchao may need a newer torch
venv=.venv211
extras=()
if [[ ${1:-} == --extras ]]; then
  shift
  venv=.venv211-extras
  # the test extra but torchtitan: torchtitan 0.3 imports torch.distributed.fsdp.DataParallelMeshDims, which
  # torch 2.11 lacks (its tests then skip); ruff and mypy check the source, not the torch release
  extras=(scikit-learn psycopg2-binary "transformers>=4.45" "accelerate>=1.0" "lightning>=2.4" "megatron-core>=0.16")
fi

if [[ ! -x $venv/bin/python ]]; then
  python=${PYTHON:-python3.12}
  if ! "$python" -c '' 2>/dev/null && [[ -z ${PYTHON:-} ]] && command -v pyenv >/dev/null; then
    v=$(pyenv versions --bare 2>/dev/null | grep -m1 '^3\.12' || true)  # installed but not the active version
    [[ -n $v ]] && python=$(pyenv root)/versions/$v/bin/python3.12
  fi
  if ! "$python" -c '' 2>/dev/null; then
    echo "compat_torch211: $python not found; using python3 ($(python3 --version)); the GPU machine runs 3.12" >&2
    python=python3
  fi
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
constraints=$(mktemp)
wheels=$(mktemp -d)
trap 'rm -rf "$constraints" "$wheels"' EXIT
printf 'torch==%s\ntorchao==%s\n' "$TORCH" "$TORCHAO" >"$constraints"

# What the GPU image has: torch and its own needs, numpy, pandas, pytest, matplotlib, tqdm, pyyaml
"${pip[@]}" -c "$constraints" "torch==$TORCH" numpy pandas pytest matplotlib tqdm pyyaml ${extras[@]+"${extras[@]}"}
# What is sent to it, as ../shared/tools/device-wheels.sh fetches it: these wheels alone, without their needs
"$venv/bin/python" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: -d "$wheels" \
  optuna alembic sqlalchemy colorlog mako greenlet "torchao==$TORCHAO"
"${pip[@]}" --no-index --no-deps "$wheels"/*.whl
"$venv/bin/python" -m pip check

export PYTHONPATH=$PWD
"$venv/bin/python" -c 'import sys, torch, torchao, optuna, autoprec
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, torchao {torchao.__version__}, "
      f"optuna {optuna.__version__}, autoprec from {autoprec.__file__}")'
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
