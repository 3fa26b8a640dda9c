#!/usr/bin/env bash
# Issue 47's MQAR cells: the peers in the recall table's protocol (results.md, "Associative recall": Zoology's data
# at width 64, 2 layers, one of Zoology's four lrs, 2.154e-3, as every row there, at most 8 epochs, stopped at
# validation >= 0.99, seed 0, one thread): Gated DeltaNet at Zoology's sizing (2 heads, keys 32, values 64) and at 4
# heads (keys 8, values 16), its [-1, 1] form, Mamba2; 64x4 of every model first, then 128x8. The memory heads and
# Llama beside them are results.md's runs (docs/recall-runs.json), in the same protocol.
#
#   bash benchmarks/recall_peers.sh [more eval/recall.py flags]
#
# Resumable by epoch, also on another machine: finished runs are in docs/peers/recall-epochs8/results.json (commit
# it), a cut run goes on from its last epoch where the checkout keeps docs/peers/recall-epochs8/checkpoints/.
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-python}" eval/recall.py --points 64x4,128x8 --models gated_deltanet-zoology,mamba2,gated_deltanet-neg,gated_deltanet \
    --threads 1 --lrs 0.002154 --epochs 8 --log-every 1 --output-dir docs/peers/recall-epochs8 "$@"
