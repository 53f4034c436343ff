#!/usr/bin/env bash
# Runs every peer benchmark whose virtualenv exists (see setup_peers.sh) and
# writes benchmarks/peers/results_<peer>.md. A peer without its venv is
# skipped with a message. Extra arguments go to every peer script, e.g.
#
#   bash benchmarks/peers/run_peers.sh                 # full: B=64,256, 7 repeats
#   bash benchmarks/peers/run_peers.sh --quick         # smoke: B=16, 2 repeats
#   bash benchmarks/peers/run_peers.sh --models mlp --batch-sizes 64
#
# Set PEERS="jax" (or "torch") to run only some of them. With --quick (or any
# extra arguments) the results go to results_<peer>.partial.md instead, so a
# smoke run never overwrites the full results.
#
# PEERS=models runs peer_models_torch.py (HF GPT-2 and BERT, torchvision
# classifiers; ~6 min on 2 CPUs at --repeats 3, ~9 at the default 5) from the
# torch venv -> results_models.md.
# It is not in the default list because of its length.
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PEERS="${PEERS:-jax torch}"
suffix=""
[ $# -gt 0 ] && suffix=".partial"

status=0
t_all=$(date +%s)
for peer in $PEERS; do
  venv="$HERE/.venv-$peer"
  script="$HERE/peer_$peer.py"
  out="$HERE/results_$peer$suffix.md"
  if [ "$peer" = models ]; then  # the model families (GPT-2, BERT, torchvision) in the torch venv
    venv="$HERE/.venv-torch"
    script="$HERE/peer_models_torch.py"
  fi
  if [ ! -x "$venv/bin/python" ]; then
    echo "[run_peers] skipping $peer: no virtualenv at $venv (run: bash benchmarks/peers/setup_peers.sh $peer)"
    continue
  fi
  echo "[run_peers] $peer: $venv/bin/python $script $* --out $out"
  t0=$(date +%s)
  if "$venv/bin/python" "$script" "$@" --out "$out"; then
    echo "[run_peers] $peer done in $(( $(date +%s) - t0 )) s -> $out"
  else
    rc=$?
    echo "[run_peers] $peer FAILED (exit $rc) after $(( $(date +%s) - t0 )) s"
    status=1
  fi
done
echo "[run_peers] all done in $(( $(date +%s) - t_all )) s"
exit $status
