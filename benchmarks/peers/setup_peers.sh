#!/usr/bin/env bash
# Creates the peer virtualenvs used by run_peers.sh:
#
#   benchmarks/peers/.venv-jax     jax + jaxlib (CPU) + numpy
#   benchmarks/peers/.venv-torch   torch==2.13.0 (CPU wheel) + opacus + numpy,
#                                  + transformers, torchvision, peft (peer_models_torch.py)
#
# These environments are optional and separate: nothing in them is ever a
# dependency of per_example_grads. Idempotent: a venv that already imports its
# packages is left alone (pass --force to rebuild both).
#
#   bash benchmarks/peers/setup_peers.sh            # both
#   bash benchmarks/peers/setup_peers.sh jax        # only one: jax | torch
#   bash benchmarks/peers/setup_peers.sh --force    # delete and rebuild
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"   # a pinned CPU build; never plain `torch`
# For peer_models_torch.py: torchvision 0.28.0 is the release built for torch 2.13.0
# (it requires torch==2.13.0); transformers and peft are the versions pip resolved
# next to it when this was written. Override together with TORCH_VERSION.
TORCHVISION_VERSION="${TORCHVISION_VERSION:-0.28.0}"
TRANSFORMERS_VERSION="${TRANSFORMERS_VERSION:-5.24.0}"
PEFT_VERSION="${PEFT_VERSION:-0.21.2}"
FORCE=0
WANT=()
for arg in "$@"; do
  case "$arg" in
    --force) FORCE=1 ;;
    jax|torch) WANT+=("$arg") ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg (expected jax, torch, --force)" >&2; exit 2 ;;
  esac
done
[ ${#WANT[@]} -eq 0 ] && WANT=(jax torch)

log() { echo "[setup_peers] $*"; }

make_venv() {  # make_venv DIR -> creates DIR unless it exists
  local dir="$1"
  if [ "$FORCE" = 1 ] && [ -d "$dir" ]; then
    log "--force: removing $dir"
    rm -rf "$dir"
  fi
  if [ -x "$dir/bin/python" ]; then
    log "venv exists: $dir"
  else
    log "creating venv: $dir (with $("$PYTHON" --version 2>&1))"
    "$PYTHON" -m venv "$dir"
    "$dir/bin/python" -m pip install --quiet --upgrade pip
  fi
}

setup_jax() {
  local dir="$HERE/.venv-jax"
  make_venv "$dir"
  if "$dir/bin/python" -c "import jax, jaxlib, numpy" 2>/dev/null; then
    log "jax venv already complete: $("$dir/bin/python" -c 'import jax, numpy; print("jax", jax.__version__, "numpy", numpy.__version__)')"
    return
  fi
  log "installing jax, jaxlib (CPU), numpy into $dir"
  "$dir/bin/python" -m pip install --quiet jax jaxlib numpy
  log "jax venv ready: $("$dir/bin/python" -c 'import jax, numpy; print("jax", jax.__version__, "numpy", numpy.__version__)')"
}

setup_torch() {
  local dir="$HERE/.venv-torch"
  make_venv "$dir"
  if "$dir/bin/python" -c "import torch, opacus, numpy" 2>/dev/null; then
    log "torch venv has torch and opacus: $("$dir/bin/python" -c 'import torch, opacus; print("torch", torch.__version__, "opacus", opacus.__version__)')"
    setup_torch_models "$dir"
    return
  fi
  if ! "$dir/bin/python" -c "import torch" 2>/dev/null; then
    log "installing torch==$TORCH_VERSION (CPU wheel) and numpy into $dir"
    "$dir/bin/python" -m pip install --quiet "torch==$TORCH_VERSION" numpy
  fi
  local have
  have="$("$dir/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')"
  # Pin the torch already installed so opacus can never pull another build.
  log "installing opacus (torch pinned to $have)"
  if ! "$dir/bin/python" -m pip install --quiet opacus "torch==$have"; then
    log "opacus with dependencies failed; installing it with --no-deps plus its small deps"
    "$dir/bin/python" -m pip install --quiet --no-deps opacus
    "$dir/bin/python" -m pip install --quiet scipy opt_einsum
  fi
  log "torch venv ready: $("$dir/bin/python" -c 'import torch, opacus, numpy; print("torch", torch.__version__, "opacus", opacus.__version__, "numpy", numpy.__version__)')"
  setup_torch_models "$dir"
}

setup_torch_models() {  # transformers, torchvision, peft for peer_models_torch.py
  local dir="$1" have
  # Checked by metadata, not import: PyPI's Linux torchvision wheel is linked against
  # the CUDA torch, so with the CPU torch its C++ ops do not load and a bare
  # `import torchvision` fails; peer_models_torch.py works around that (see there).
  if "$dir/bin/python" -c "
import importlib.metadata as m
for p in ('transformers', 'torchvision', 'peft'):
    m.version(p)" 2>/dev/null; then
    log "torch venv already has transformers, torchvision, peft"
    return
  fi
  have="$("$dir/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')"
  log "installing torchvision==$TORCHVISION_VERSION transformers==$TRANSFORMERS_VERSION (torch pinned to $have)"
  "$dir/bin/python" -m pip install --quiet "torch==$have" "torchvision==$TORCHVISION_VERSION" \
    "transformers==$TRANSFORMERS_VERSION"
  log "installing peft==$PEFT_VERSION (optional: only the gpt2-lora model needs it)"
  if ! "$dir/bin/python" -m pip install --quiet "torch==$have" "transformers==$TRANSFORMERS_VERSION" \
      "peft==$PEFT_VERSION"; then
    log "peft did not install; peer_models_torch.py will skip gpt2-lora"
  fi
  log "model packages: $("$dir/bin/python" -c "
import importlib.metadata as m
print(', '.join(p + ' ' + m.version(p) for p in ('torchvision', 'transformers', 'peft', 'accelerate')))" 2>/dev/null)"
}

for peer in "${WANT[@]}"; do
  "setup_$peer"
done
log "done. Run the peers with: bash benchmarks/peers/run_peers.sh"
