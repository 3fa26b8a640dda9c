#!/usr/bin/env bash
# Issue 47's MQAR cells: the peers in the recall table's protocol (results.md, "Associative recall": Zoology's data
# at width 64, 2 layers, at most 8 epochs, stopped at validation >= 0.99, seed 0, one thread): Gated DeltaNet at
# Zoology's sizing (2 heads, keys 32, values 64), at 4 heads (keys 8, values 16) and with the memory heads' shape (4
# heads, keys and values 16: 1,792 state floats a layer against their 1,860), each also in its [-1, 1] form; Mamba2.
# First every model at both points at the table's lr, 2.154e-3 (one of Zoology's four, the memory heads' and Llama's
# there, docs/recall-runs.json); then Zoology's other three lrs, the table keeping each model's best by validation.
#
#   bash benchmarks/recall_peers.sh [more eval/recall.py flags]
#
# Resumable by epoch, also on another machine: finished runs are in docs/peers/recall-epochs8/results.json (commit
# it), a cut run goes on from its last epoch where the checkout keeps docs/peers/recall-epochs8/checkpoints/. Cells
# run apart (one model and lr a folder, two at a time: docs/peers/recall-*/results.json) are not run again.
set -euo pipefail
cd "$(dirname "$0")/.."
apart=()
for f in docs/peers/recall-*/results.json; do
    [[ -e $f && $f != */recall-epochs8/* ]] && apart+=("$f")
done
apart=$(IFS=,; echo "${apart[*]}")
for lrs in 0.002154 0.0001,0.0004642,0.01; do
    "${PYTHON:-python}" eval/recall.py --points 64x4,128x8 --lrs $lrs --threads 1 --epochs 8 --log-every 1 \
        --models gated_deltanet-zoology,mamba2,gated_deltanet-neg,gated_deltanet,gated_deltanet-square-neg,gated_deltanet-square \
        --output-dir docs/peers/recall-epochs8 ${apart:+--skip-runs-in "$apart"} "$@"
done
