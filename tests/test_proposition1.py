"""Proposition 1 of the paper: a full bilinear RNN with hand-set weights simulates any finite automaton."""

import random

import torch

from bilinear_lm import BilinearConfig, BilinearForCausalLM


def random_automaton(num_states, num_symbols, seed):
    rng = random.Random(seed)
    return [[rng.randrange(num_states) for _ in range(num_symbols)] for _ in range(num_states)]


def simulate(delta, start, symbols):
    state, states = start, []
    for s in symbols:
        state = delta[state][s]
        states.append(state)
    return states


def automaton_model(delta, start):
    """The paper's minimal model (one `full` layer, no MLP, linear readout) with hand-set weights.

    Hidden dims [0, S) carry the readout of the state, dims [S, S + K) the one-hot input symbol. The input
    factors are the one-hot symbol (up to a positive factor, which scale invariance ignores), the transition
    for symbol k is the 0/1 matrix of the automaton, and h_0 is the one-hot start state.
    """
    S, K = len(delta), len(delta[0])
    config = BilinearConfig(vocab_size=max(S, K), hidden_size=S + K, num_hidden_layers=1, use_mlp=False,
                            mixer_type="full", num_heads=1, state_size=S, rank=K, use_gate=False,
                            tie_word_embeddings=False, norm_chunk_size=64)
    model = BilinearForCausalLM(config).eval()
    mixer = model.model.layers[0].mixer
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.model.embed_tokens.weight[torch.arange(K), S + torch.arange(K)] = 1.0
        model.model.layers[0].mixer_norm.weight.fill_(1.0)
        model.model.norm.weight.fill_(1.0)
        mixer.in_proj.weight[torch.arange(K), S + torch.arange(K)] = 1.0
        for i in range(S):
            for k in range(K):
                mixer.transition.W[0, delta[i][k], i, k] = 1.0
        mixer.h_start[0, start] = 1.0
        mixer.state_norm.weight.fill_(1.0)
        mixer.out_proj.weight[torch.arange(S), torch.arange(S)] = 100.0
        model.lm_head.weight[torch.arange(S), torch.arange(S)] = 1.0
    return model


def test_full_bilinear_simulates_a_random_automaton_exactly_at_length_10000():
    delta = random_automaton(num_states=7, num_symbols=5, seed=3)
    model = automaton_model(delta, start=2)
    rng = random.Random(0)
    symbols = [rng.randrange(5) for _ in range(10_000)]
    with torch.no_grad():
        logits = model(torch.tensor([symbols])).logits[0, :, :7]
    predicted = logits.argmax(-1).tolist()
    assert predicted == simulate(delta, 2, symbols)
    # the true state wins by a wide margin at every position, not by a rounding accident
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1.0
