#!/usr/bin/env bash
# Creates the peer virtualenvs used by run_peers.sh:
#
#   benchmarks/peers/.venv-jax     jax + jaxlib (CPU) + numpy
#   benchmarks/peers/.venv-torch   torch==2.13.0 (CPU wheel) + opacus + numpy
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
    log "torch venv already complete: $("$dir/bin/python" -c 'import torch, opacus; print("torch", torch.__version__, "opacus", opacus.__version__)')"
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
}

for peer in "${WANT[@]}"; do
  "setup_$peer"
done
log "done. Run the peers with: bash benchmarks/peers/run_peers.sh"
