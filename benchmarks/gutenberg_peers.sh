#!/usr/bin/env bash
# Issue 47, Gutenberg step 1: each model's learning rate, the best of {1e-3, 5e-4, 2e-3} at 10 minutes of one core
# (seed 1337), for the bilinear family (pure, memory heads, hybrid 3:1) and its peers (Gated DeltaNet, its 3:1
# hybrid, Mamba2, Llama), all parameter-matched by the factory. Two runs at a time, one thread each; the step counts
# come from calibrations at one thread on an otherwise idle machine.
#
#   BILINEAR_LM_DATA_DIR=DIR bash benchmarks/gutenberg_peers.sh [more equal_time.py flags]
#
# Resumable, also on another machine: every calibration and finished run is appended to
# docs/peers/gutenberg-lr-sweep.jsonl (commit it) and is not run again; the table goes to docs/peers/gutenberg-lr-sweep.md.
set -euo pipefail
cd "$(dirname "$0")/.."
H="--model.layer_types [bilinear,bilinear,bilinear,full_attention] --model.num_attention_heads 4 --model.num_key_value_heads 4"
M="--model.memory_heads 4 --model.memory_key_size 32 --model.memory_value_size 32 --model.intermediate_size 512"
models=("bilinear=" "memory=$M" "hybrid=$H" "gated_deltanet=--model_type gated_deltanet"
        "gated_deltanet_hybrid=--model_type gated_deltanet $H" "mamba2=--model_type mamba2" "llama=--model_type llama")
runs=()
for lr in 1e-3 5e-4 2e-3; do
    for spec in "${models[@]}"; do
        runs+=(--run "${spec%%=*}@$lr=${spec#*=} --learning_rate $lr")
    done
done
exec "${PYTHON:-python}" benchmarks/equal_time.py --preset gutenberg --jobs 2 --evals 1 --eval-iters 100 \
    --calibration-steps 40 --budgets 600 --seeds 1337 --workdir runs/gutenberg_peers \
    --record docs/peers/gutenberg-lr-sweep.jsonl --output docs/peers/gutenberg-lr-sweep.md "${runs[@]}" "$@"
