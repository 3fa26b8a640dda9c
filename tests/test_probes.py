"""State-tracking task generators versus brute-force simulations written independently here."""
import itertools
import json

import pytest
import torch

from bilinear_lm.probes import Automaton, load_automaton, make_task
from bilinear_lm.probes.tasks import AUTOMATON_TASK_NAMES


def sample(task, batch=16, length=23, seed=0):
    tokens, labels = task.sample(batch, length, torch.Generator().manual_seed(seed))
    assert tokens.dtype == labels.dtype == torch.long
    assert tokens.shape == labels.shape == (batch, length)
    assert 0 <= int(tokens.min()) and int(tokens.max()) < task.vocab_size
    assert 0 <= int(labels.min()) and int(labels.max()) < task.num_classes
    return tokens.tolist(), labels.tolist()


def test_parity():
    task = make_task("parity")
    assert (task.vocab_size, task.num_classes) == (2, 2)
    for seq, lab in zip(*sample(task)):
        assert lab == [sum(seq[: t + 1]) % 2 for t in range(len(seq))]


@pytest.mark.parametrize("m", [2, 5, 10])
def test_modular_addition(m):
    task = make_task("modular_addition", m)
    assert (task.vocab_size, task.num_classes) == (m, m)
    for seq, lab in zip(*sample(task)):
        running, expected = 0, []
        for x in seq:
            running = (running + x) % m
            expected.append(running)
        assert lab == expected


def _expr(seq, m):
    """Token list -> (Python source of the longest prefix ending in a number, list of its pieces)."""
    ops = {m: "+", m + 1: "-", m + 2: "*"}
    return [str(x) if x < m else ops[x] for x in seq]


@pytest.mark.parametrize("m", [3, 5])
def test_modular_arithmetic_left_to_right(m):
    task = make_task("modular_arithmetic", m)
    assert (task.vocab_size, task.num_classes) == (m + 3, m)
    for seq, lab in zip(*sample(task, length=25)):
        pieces = _expr(seq, m)
        assert all(p.isdigit() for p in pieces[::2]) and all(not p.isdigit() for p in pieces[1::2])
        for t in range(len(seq)):
            k = t if t % 2 == 0 else t - 1          # last number position
            value = int(pieces[0])
            for i in range(1, k, 2):
                value = eval(f"({value}){pieces[i]}({pieces[i + 1]})")  # exact integers, reduce at the end
            assert lab[t] == value % m, (pieces[: t + 1], lab[t])


@pytest.mark.parametrize("m", [3, 5, 7])
def test_modular_arithmetic_precedence(m):
    task = make_task("modular_arithmetic_precedence", m)
    assert (task.vocab_size, task.num_classes) == (m + 3, m)
    for seq, lab in zip(*sample(task, length=21)):
        pieces = _expr(seq, m)
        for t in range(len(seq)):
            k = t if t % 2 == 0 else t - 1
            assert lab[t] == eval("".join(pieces[: k + 1])) % m, ("".join(pieces[: t + 1]), lab[t])


def test_modular_arithmetic_precedence_differs_from_left_to_right():
    m = 5
    a = make_task("modular_arithmetic", m).labels(torch.tensor([[1, m, 2, m + 2, 3]]))
    b = make_task("modular_arithmetic_precedence", m).labels(torch.tensor([[1, m, 2, m + 2, 3]]))
    assert a[0, -1].item() == (1 + 2) * 3 % m and b[0, -1].item() == (1 + 2 * 3) % m
    # "1 - 2 * 3 + 4 * 4": unary-free precedence with subtraction of a product
    toks = [1, m + 1, 2, m + 2, 3, m, 4, m + 2, 4]
    assert make_task("modular_arithmetic_precedence", m).labels(torch.tensor([toks]))[0, -1].item() == (1 - 6 + 16) % m


@pytest.mark.parametrize("m", [3, 5, 8])
def test_cycle_navigation(m):
    task = make_task("cycle_navigation", m)
    assert (task.vocab_size, task.num_classes) == (3, m)
    move = {0: 0, 1: 1, 2: -1}
    for seq, lab in zip(*sample(task, length=40)):
        pos, expected = 0, []
        for x in seq:
            pos = (pos + move[x]) % m
            expected.append(pos)
        assert lab == expected


def test_random_fsm_table_and_labels():
    task = make_task("random_fsm", 7, num_symbols=4, fsm_seed=3)
    assert (task.vocab_size, task.num_classes) == (4, 7)
    table = task.automaton.delta.tolist()           # table[symbol][state]
    assert torch.equal(make_task("random_fsm", 7, num_symbols=4, fsm_seed=3).automaton.delta, task.automaton.delta)
    assert not torch.equal(make_task("random_fsm", 7, num_symbols=4, fsm_seed=4).automaton.delta, task.automaton.delta)
    assert make_task("random_fsm", 6).vocab_size == 6  # alphabet defaults to m
    for seq, lab in zip(*sample(task, length=50)):
        q, expected = 0, []
        for x in seq:
            q = table[x][q]
            expected.append(q)
        assert lab == expected


def _perm_parity_by_cycles(p):
    seen, transpositions = set(), 0
    for i in range(len(p)):
        if i in seen:
            continue
        j, length = i, 0
        while j not in seen:
            seen.add(j)
            j = p[j]
            length += 1
        transpositions += length - 1
    return transpositions % 2 == 0


@pytest.mark.parametrize("group,order", [("S3", 6), ("A4", 12), ("A5", 60), ("S5", 120)])
@pytest.mark.parametrize("symbols", ["elements", "generators"])
def test_permutation_word_problem(group, order, symbols):
    n = int(group[1])
    perms = sorted(itertools.permutations(range(n)))
    elems = perms if group[0] == "S" else [p for p in perms if _perm_parity_by_cycles(p)]
    assert len(elems) == order
    task = make_task(f"permutation_{group}", symbols=symbols)
    assert task.num_classes == order
    assert task.vocab_size == (order if symbols == "elements" else 2)
    if symbols == "elements":
        sym = elems
    else:
        sym = [eval(s) for s in task.automaton.symbol_names]
        assert all(s in elems for s in sym)
        # the generators generate the whole group (closure under right multiplication)
        reached, frontier = {tuple(range(n))}, [tuple(range(n))]
        while frontier:
            p = frontier.pop()
            for s in sym:
                q = tuple(s[p[i]] for i in range(n))
                if q not in reached:
                    reached.add(q)
                    frontier.append(q)
        assert len(reached) == order
    for seq, lab in zip(*sample(task, length=30)):
        prod = tuple(range(n))
        for t, x in enumerate(seq):
            g = sym[x]
            prod = tuple(g[prod[i]] for i in range(n))       # x_t o ... o x_1 (x_1 applied first)
            assert lab[t] == elems.index(prod)


@pytest.mark.parametrize("name", [n for n in AUTOMATON_TASK_NAMES if n != "automaton"])
def test_transition_matrices_simulate_the_automaton(name):
    """h_t = A(x_t) h_{t-1} with one-hot h and the readout matrix reproduces the labels (float64)."""
    task = make_task(name)
    auto = task.automaton
    A, R, h0 = auto.transition_matrices(torch.float64), auto.output_matrix(torch.float64), auto.start_vector(torch.float64)
    assert A.shape == (auto.num_symbols, auto.num_states, auto.num_states)
    assert torch.equal(A.sum(1), torch.ones(auto.num_symbols, auto.num_states, dtype=torch.float64))  # columns one-hot
    tokens, labels = task.sample(4, 60, torch.Generator().manual_seed(1))
    h = h0.expand(4, -1)
    for t in range(60):
        h = torch.einsum("bij,bj->bi", A[tokens[:, t]], h)
        assert torch.equal((h @ R.T).argmax(-1), labels[:, t])


def test_sampling_is_deterministic_and_arithmetic_alternates():
    task = make_task("modular_arithmetic", 5)
    a = task.sample(8, 11, torch.Generator().manual_seed(5))
    b = task.sample(8, 11, torch.Generator().manual_seed(5))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert (a[0][:, ::2] < 5).all() and (a[0][:, 1::2] >= 5).all()


def test_unknown_task_and_bad_m():
    with pytest.raises(ValueError, match="unknown task"):
        make_task("nope")
    with pytest.raises(ValueError, match="m must be an integer >= 2"):
        make_task("modular_addition", 1)
    with pytest.raises(ValueError, match="unknown task .permutation_S7"):
        make_task("permutation_S7")
    with pytest.raises(ValueError, match="--automaton-file"):
        make_task("automaton")


# ---------------------------------------------------------------------------- JSON automata
GOOD = {
    "name": "mod3_counter",
    "states": ["q0", "q1", "q2"],
    "alphabet": ["inc", "dec", "nop"],
    "start": "q0",
    "transitions": {
        "q0": {"inc": "q1", "dec": "q2", "nop": "q0"},
        "q1": {"inc": "q2", "dec": "q0", "nop": "q1"},
        "q2": {"inc": "q0", "dec": "q1", "nop": "q2"},
    },
}


def write(tmp_path, obj, name="a.json"):
    p = tmp_path / name
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return p


def test_json_automaton_roundtrip_and_task(tmp_path):
    auto = load_automaton(write(tmp_path, GOOD))
    assert (auto.num_states, auto.num_symbols, auto.start, auto.name) == (3, 3, 0, "mod3_counter")
    task = make_task("automaton", path=write(tmp_path, GOOD))
    step = {0: 1, 1: -1, 2: 0}
    for seq, lab in zip(*sample(task)):
        q, expected = 0, []
        for x in seq:
            q = (q + step[x]) % 3
            expected.append(q)
        assert lab == expected
    again = Automaton.from_dict(auto.to_dict())
    assert torch.equal(again.delta, auto.delta) and again.start == auto.start


def test_json_list_form_outputs_and_probs(tmp_path):
    spec = {"states": ["a", "b"], "alphabet": ["x", "y"], "start": "b",
            "transitions": [["a", 1], [0, "b"]],     # rows per state, columns per symbol
            "outputs": {"a": "reject", "b": "accept"}, "symbol_probs": {"x": 1.0, "y": 0.0}}
    task = make_task("automaton", path=write(tmp_path, spec))
    assert task.num_classes == 2 and task.automaton.class_names == ["reject", "accept"]
    tokens, labels = task.sample(5, 6, torch.Generator().manual_seed(0))
    assert (tokens == 0).all()                       # y has weight 0
    # from b on x -> 0 (a), then a on x -> a
    assert (labels == task.automaton.class_names.index("reject")).all()


@pytest.mark.parametrize("probs", [[3.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.1, 0.7, 0.2], [2.0, 33.0, 7.0]])
def test_json_roundtrip_keeps_every_field_including_symbol_probs(tmp_path, probs):
    """to_dict -> JSON file -> load_automaton (and -> from_dict) gives back the same automaton, sampling weights
    included: the weights given, normalized."""
    spec = dict(json.loads(json.dumps(GOOD)), outputs={"q0": "zero", "q1": "other", "q2": "other"},
                symbol_probs=dict(zip(GOOD["alphabet"], probs)))
    auto = load_automaton(write(tmp_path, spec))
    expected = torch.tensor(probs, dtype=torch.float64) / sum(probs)
    torch.testing.assert_close(auto.symbol_probs, expected, rtol=0, atol=1e-15)
    path = tmp_path / "again.json"
    auto.save_json(path)
    for again in (load_automaton(path), Automaton.from_dict(auto.to_dict())):
        assert torch.equal(again.delta, auto.delta) and torch.equal(again.outputs, auto.outputs)
        assert (again.start, again.name, again.state_names, again.symbol_names, again.class_names) == (
            auto.start, auto.name, auto.state_names, auto.symbol_names, auto.class_names)
        assert torch.equal(again.symbol_probs, auto.symbol_probs)
    uniform = load_automaton(write(tmp_path, GOOD, "uniform.json"))
    assert uniform.symbol_probs is None and uniform.to_dict() == GOOD


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d.pop("states"), "missing required key 'states'"),
    (lambda d: d.pop("transitions"), "missing required key 'transitions'"),
    (lambda d: d.update(start="q9"), "start state 'q9' is not one of the states"),
    (lambda d: d.update(states=["q0", "q1", "q1"]), "duplicate entries"),
    (lambda d: d.update(alphabet=[]), "'alphabet' must be a non-empty list"),
    (lambda d: d["transitions"]["q1"].pop("dec"), r"'transitions'\['q1'\] is missing symbol 'dec'"),
    (lambda d: d["transitions"]["q2"].update(nop="q7"), r"'transitions'\['q2'\]\['nop'\] = 'q7' is not one of the states"),
    (lambda d: d["transitions"]["q0"].update(jump="q1"), "uses symbol\\(s\\) \\['jump'\\] not in the alphabet"),
    (lambda d: d["transitions"].pop("q2"), "no entry for state 'q2'"),
    (lambda d: d["transitions"].update(q5={}), r"unknown state\(s\) \['q5'\]"),
    (lambda d: d.update(transitions="q0->q1"), "'transitions' must be an object"),
    (lambda d: d.update(colour="red"), r"unknown key\(s\) \['colour'\]"),
    (lambda d: d.update(outputs={"q0": "a"}), r"'outputs' is missing state\(s\) \['q1', 'q2'\]"),
    (lambda d: d.update(symbol_probs=[1, -1, 0]), "non-negative numbers"),
    (lambda d: d.update(transitions=[["q0", "q0", "q0"]]), "one row per state"),
])
def test_json_errors_name_the_problem(tmp_path, mutate, match):
    spec = json.loads(json.dumps(GOOD))
    mutate(spec)
    path = write(tmp_path, spec)
    with pytest.raises(ValueError, match=match) as e:
        load_automaton(path)
    assert str(path) in str(e.value)


def test_json_file_level_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_automaton(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="not valid JSON .* line 1"):
        load_automaton(write(tmp_path, "{\"states\": [}"))
    with pytest.raises(ValueError, match="top level must be a JSON object"):
        load_automaton(write(tmp_path, "[1, 2]"))


@pytest.mark.parametrize("kwargs,match", [
    (dict(delta=[[0, 1], [1, 0]], symbol_probs=[1.0]), r"one weight per symbol \(2\), got shape \(1,\)"),
    (dict(delta=[[0, 1], [1, 0]], symbol_probs=[1.0, -1.0]), "finite non-negative weights, not all zero"),
    (dict(delta=[[0, 1], [1, 0]], symbol_probs=[0.0, float("nan")]), "finite non-negative weights"),
    (dict(delta=[[0, 2], [1, 0]]), r"delta entries must be state ids in \[0, 2\)"),
    (dict(delta=[[0, 1]], start=5), r"start state 5 is not in \[0, 2\)"),
    (dict(delta=[[0, 1]], outputs=[0]), r"outputs must have one class per state \(2\)"),
])
def test_bad_automaton_construction_names_the_problem(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Automaton(name="mine", **kwargs)


def test_each_transition_type_gives_its_probe_defaults():
    """The probe model of each type takes that type's defaults (``Transition.probe_overrides``): ``full`` one state
    matrix per task symbol, the others rank = state size, ``block_diagonal`` its block size; ``--rank`` wins."""
    from bilinear_lm.modeling.configuration_bilinear import MIXER_TYPES
    from bilinear_lm.probes import ProbeConfig, build_probe_model, make_task

    task = make_task("modular_addition", 5)
    config = ProbeConfig(state_size=8, block_size=4)
    for mixer in MIXER_TYPES:
        model, cfg = build_probe_model(f"bilinear-{mixer}", task, config)
        assert model.config.mixer_type == mixer
        assert cfg["rank"] == (task.vocab_size if mixer == "full" else 8), mixer
        assert ("block_size" in cfg) == (mixer == "block_diagonal") and model.config.block_size in (2, 4)
    _, cfg = build_probe_model("bilinear-full", task, ProbeConfig(state_size=8, rank=3))
    assert cfg["rank"] == 3
    _, cfg = build_probe_model("bilinear-block_diagonal", task, config)
    assert cfg["block_size"] == 4


def test_probe_models_take_memory_heads():
    """``--memory-heads`` / ``--memory-size`` put memory heads beside the bilinear probe model's tracking head (and
    leave the baselines alone); a negative count is refused naming the field."""
    from bilinear_lm.probes import ProbeConfig, build_probe_model, make_task

    task = make_task("modular_addition", 5)
    config = ProbeConfig(state_size=8, memory_heads=2, memory_size=4)
    model, cfg = build_probe_model("bilinear-cp", task, config)
    memory = model.model.layers[0].mixer.memory
    assert (memory.num_heads, memory.key_size, memory.value_size) == (2, 4, 4) and cfg["memory_heads"] == 2
    assert build_probe_model("bilinear-cp", task, ProbeConfig(state_size=8))[0].model.layers[0].mixer.memory is None
    assert "memory_heads" not in build_probe_model("transformer-1", task, config)[1]
    with pytest.raises(ValueError, match="memory_heads"):
        ProbeConfig(memory_heads=-1)
