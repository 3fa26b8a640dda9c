#!/usr/bin/env bash
# Issue 47, the field's formal-language protocol at a CPU budget: Grazzi et al.'s parity and modular arithmetic without
# and with brackets (train lengths 3-40, test 40-256, 38 sequences a length, scaled accuracy pooled over the test
# lengths, the model selected at length 256), 1,000 steps of batch 256 (the papers: 20k-100k steps), width 128, for
# the bilinear family and its peers; seed 0 of every task first (parity, then without brackets, then with: at 1,000
# steps no model learned the bracket task on 2026-11-29, results-history.md), then A5 and S5 tested at 40-5,120, then
# seeds 1 and 2 of the three. One thread.
#
#   bash benchmarks/field_peers.sh [more eval/state_tracking.py flags]
#
# Resumable, also on another machine: the finished runs are in docs/peers/{field,groups}-steps1000/results.json and
# groups-steps10000/results.json (commit them; their table.md and plots are rewritten at each call's end), and a run
# cut in the middle goes on from its last validation where the checkout keeps docs/peers/*/checkpoints/. Last, the
# groups again at 10,000 steps (validation every 500): about 30 min of one core a bilinear run, 1-5 h a peer's.
set -euo pipefail
cd "$(dirname "$0")/.."
models=stack-4,hybrid-4,gated_deltanet_neg-3,gated_deltanet-3,mamba2-3,transformer-3,lstm
probe() { OMP_NUM_THREADS=1 "${PYTHON:-python}" eval/state_tracking.py --sweep --models "$models" --train-lengths 3-40 \
    --val-length 256 --batch-size 256 --hidden-size 128 --num-heads 4 --steps 1000 --eval-every 100 --threads 1 "$@"; }
field() { probe --tasks field_parity,field_modular_arithmetic,field_modular_arithmetic_brackets --seeds "$1" \
    --test-lengths 40-256 --test-size 38 --output-dir docs/peers/field-steps1000 "${@:2}"; }
field 0 "$@"
# the groups A5 and S5 (tokens: the group's elements, the label: the running product), seed 0, tested at 1 to 128
# times the longest training length
groups() { probe --tasks permutation_A5,permutation_S5 --permutation-symbols elements --seeds 0 \
    --test-lengths 40,256,1024,5120 --test-size 100 "$@"; }
groups --output-dir docs/peers/groups-steps1000 "$@"
field 1,2 "$@"
groups --steps 10000 --eval-every 500 --output-dir docs/peers/groups-steps10000 "$@"
