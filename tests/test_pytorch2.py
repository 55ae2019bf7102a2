"""rnnkit in PyTorch 2 (issue 13): torch.compile, torch.export / AOTInductor, torch.func, ONNX of
whole models, autocast, the step API against torch.nn's cells, the custom ops' own checks, and
double backward.

Every layer is tried inside a small model, embedding -> rnnkit layer -> linear (:class:`Model`),
over the configurations of :data:`CONFIGS`, on the backends that run on this machine:

- ``fused``: the compiled CPU kernels, the custom ops ``rnnkit::fused_pass_forward / _backward``;
- ``auto`` on the plain configurations: torch's own oneDNN op (native) in eager, rerouted to the
  fused ops under torch.compile / torch.export / torch.func (what ran is asserted);
- ``reference`` where it is feasible (it is a Python loop over time: compile unrolls it, export
  specializes T);
- ``native`` asked for by name: a clear refusal where it cannot run.

Comparisons use the one tolerance table (rnnkit.testing, via helpers.assert_close): relative RMS
error, 1e-5 in float32, 1e-10 in float64. Compiled cases use tiny sizes and reset Dynamo before
each compile (each model instance would otherwise add a cache entry to ``Model.forward``).
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from torch._inductor.compile_fx import compile_fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export import Dim
from torch.func import functional_call, grad, stack_module_state, vmap

import rnnkit
from rnnkit.fused import build
from rnnkit.fused.ops import OPS
from rnnkit.masks import draw_pass
from rnnkit.passes import mask_tensors, pass_scalars, pass_values
from rnnkit.testing import TOLERANCE
from helpers import assert_close, flatten, map_tree, require_fused_kernels

SRC = str(Path(rnnkit.__file__).resolve().parents[1])  # this checkout's src/, for the fresh processes
FUSED_FORWARD = "rnnkit.fused_pass_forward.default"
FUSED_BACKWARD = "rnnkit.fused_pass_backward.default"


@pytest.fixture(autouse=True, scope="module")
def fused_kernels():
    """The fused kernels are built (or loaded) once, before anything is timed or traced."""
    require_fused_kernels()
    yield


# ---- the small model and the configurations ----------------------------------------------------

VOCAB, INPUT, HIDDEN, CLASSES = 11, 4, 8, 3


class Model(torch.nn.Module):
    """Embedding -> rnnkit layer -> linear head; returns (logits, final states)."""

    def __init__(self, rnn):
        super().__init__()
        spec = rnn.spec
        self.embedding = torch.nn.Embedding(VOCAB, spec.input_size)
        self.rnn = rnn
        top = spec.output_size(spec.num_layers - 1)
        self.head = torch.nn.Linear(top * (spec.num_directions if spec.merge == "concat" else 1), CLASSES)

    def forward(self, tokens, lengths=None):
        y, hy = self.rnn(self.embedding(tokens), None, lengths)
        return self.head(y), hy


# name -> (layer factory taking backend=..., uses lengths=, torch.nn's kernels compute it (plain))
CONFIGS = {
    "lstm": (lambda **kw: rnnkit.LSTM(INPUT, HIDDEN, **kw), False, True),
    "gru": (lambda **kw: rnnkit.GRU(INPUT, HIDDEN, **kw), False, True),
    "rnn": (lambda **kw: rnnkit.RNN(INPUT, HIDDEN, **kw), False, True),
    "lstm_peephole_ln": (lambda **kw: rnnkit.LSTM(INPUT, HIDDEN, peephole=True, layer_norm=True, **kw), True, False),
    "lstm_zoneout_eval": (lambda **kw: rnnkit.LSTM(INPUT, HIDDEN, zoneout=(0.2, 0.1), **kw), False, False),
    "lstm_proj": (lambda **kw: rnnkit.LSTM(INPUT, HIDDEN, proj_size=5, **kw), False, False),
    "gru_per_layer": (lambda **kw: rnnkit.GRU(INPUT, [HIDDEN, 6], num_layers=2, **kw), True, False),
    "lstm_bidir2_lengths": (lambda **kw: rnnkit.LSTM(INPUT, HIDDEN, num_layers=2, bidirectional=True, **kw), True,
                            True),
}
PLAIN = [name for name, (_, _, plain) in CONFIGS.items() if plain]
# (config, backend): fused everywhere; auto on the plain configurations (eager: native for an LSTM's inference)
CASES = [(name, "fused") for name in CONFIGS] + [(name, "auto") for name in PLAIN]
CASE_IDS = [f"{name}-{backend}" for name, backend in CASES]
T, B = 5, 3
LENGTHS = torch.tensor([5, 2, 4])


def make_model(name, backend, seed=0):
    torch.manual_seed(seed)
    factory, _, _ = CONFIGS[name]
    model = Model(factory(backend=backend))
    with torch.no_grad():  # LN gains 1 / shifts 0 would make their gradients degenerate
        model.rnn.flat_weights.add_(0.1 * torch.randn_like(model.rnn.flat_weights))
    return model.eval() if "zoneout" in name else model.train()


def inputs(name, steps=T, batch=B, seed=1):
    """(tokens [steps, batch], lengths [batch] or None) for a configuration: with lengths, one
    full-length sequence, the others shorter, the last of length 1 when batch > 2."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (steps, batch), generator=generator)
    if not CONFIGS[name][1]:
        return tokens, None
    lengths = torch.randint(1, steps + 1, (batch,), generator=generator)
    lengths[0] = steps
    if batch > 2:
        lengths[-1] = 1
    return tokens, lengths


def outputs_of(out):
    """The model's (logits, final states) as a flat list of tensors."""
    logits, hy = out
    return [logits] + flatten(hy)


def upstream(tensors, seed=2):
    """Random upstream gradients (never ones_like) shaped like ``tensors``."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(t.shape, generator=generator, dtype=torch.float64).to(t.dtype) for t in tensors]


def loss_of(out, seed=2):
    tensors = outputs_of(out)
    return sum((t * g).sum() for t, g in zip(tensors, upstream(tensors, seed)))


class RecordingInductor:
    """A torch.compile backend: Inductor (compile_fx), recording every graph Dynamo hands it, so a
    test can count compilations (a recompile is one more graph) and see which ops were traced."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return compile_fx(gm, example_inputs)

    @property
    def compilations(self) -> int:
        """Graphs compiled, not counting the empty graph Dynamo hands over when it restarts the
        analysis of a frame (with dynamic=True it does so to specialize a float attribute, e.g.
        nn.Embedding's norm_type): a recompile is one more non-empty graph."""
        return sum(any(node.op == "call_function" for node in gm.graph.nodes) for gm in self.graphs)

    def ops(self):
        """The call_function targets of every recorded graph and its subgraphs (autograd.Function
        bodies are submodules), as strings."""
        return {str(node.target) for gm in self.graphs for module in gm.modules()
                if isinstance(module, torch.fx.GraphModule)
                for node in module.graph.nodes if node.op == "call_function"}


class RecordingEager(RecordingInductor):
    """Like RecordingInductor, running the captured graph as it is (for counting only: cheap)."""

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward


def rnnkit_ops(ops):
    return {op for op in ops if op.startswith("rnnkit.")}


def recurrent_aten_ops(ops):
    """torch's own recurrent ops (the native backend's) among traced ops."""
    return {op for op in ops if any(k in op for k in ("lstm", "gru", "rnn_tanh", "rnn_relu", "mkldnn_rnn"))}


AUTO_BATCH = 6  # auto runs an LSTM's inference of a padded batch of 5 rows or more on oneDNN (native)


def expected_eager_backend(name, backend, training):
    """The backend of an eager call (auto's inference inputs have AUTO_BATCH rows, its training
    inputs B): auto runs torch's oneDNN kernel for a plain LSTM's inference of a padded batch, and
    with lengths too on a CPU without AVX-512 (backend.select); else fused."""
    if backend == "auto" and not training:
        avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
        return "native" if name == "lstm" or (name == "lstm_bidir2_lengths" and not avx512) else "fused"
    return "fused" if backend == "auto" else backend


# ---- 1. torch.compile --------------------------------------------------------------------------

@pytest.mark.parametrize("name, backend", CASES + [("gru", "reference")], ids=CASE_IDS + ["gru-reference"])
def test_compile_has_no_graph_breaks(name, backend):
    """torch._dynamo.explain of a training call (gradients on: the autograd.Function path) sees one
    graph and no break (the fullgraph=True tests below cover inference too)."""
    model = make_model(name, backend)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(*inputs(name))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("name, backend", CASES, ids=CASE_IDS)
def test_compile_inference_matches_eager(name, backend):
    """fullgraph=True, no_grad: logits and final states equal eager; the traced graph runs the fused
    custom op (auto included: torch's oneDNN op does not trace) and no torch RNN op."""
    model = make_model(name, backend)
    tokens, lengths = inputs(name, batch=AUTO_BATCH if backend == "auto" else B)
    with torch.no_grad():
        expected = outputs_of(model(tokens, lengths))
    assert model.rnn.last_backend == expected_eager_backend(name, backend, training=False)
    model.rnn.last_backend = None
    torch._dynamo.reset()
    recorder = RecordingInductor()
    compiled = torch.compile(model, fullgraph=True, backend=recorder)
    with torch.no_grad():
        actual = outputs_of(compiled(tokens, lengths))
    assert_close(actual, expected, f"{name} compiled inference")
    assert recorder.compilations == 1
    assert rnnkit_ops(recorder.ops()) == {FUSED_FORWARD}
    assert not recurrent_aten_ops(recorder.ops())
    assert model.rnn.last_backend is None  # only eager calls record what ran


# auto compiles to the same fused graph as fused (and trains on fused in eager too): one auto case is enough
TRAINING_CASES = [(name, "fused") for name in CONFIGS] + [("lstm_bidir2_lengths", "auto")]


@pytest.mark.parametrize("name, backend", TRAINING_CASES, ids=[f"{n}-{b}" for n, b in TRAINING_CASES])
def test_compile_training_step_matches_eager(name, backend):
    """fullgraph=True with gradients: logits, final states and every parameter's gradient equal
    eager; after one SGD step on each, the next outputs still agree."""
    model = make_model(name, backend)
    twin = copy.deepcopy(model)
    tokens, lengths = inputs(name)
    torch._dynamo.reset()
    recorder = RecordingInductor()
    compiled = torch.compile(model, fullgraph=True, backend=recorder)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin)]
    for step in range(2):
        out_c, out_e = compiled(tokens, lengths), twin(tokens, lengths)
        assert_close(outputs_of(out_c), outputs_of(out_e), f"{name} step {step} outputs")
        for optimizer, out in zip(optimizers, (out_c, out_e)):
            optimizer.zero_grad()
            loss_of(out).backward()
        for (param_name, p_c), p_e in zip(model.named_parameters(), twin.parameters()):
            assert p_c.grad is not None, f"{param_name}: no gradient through the compiled model"
            assert_close(p_c.grad, p_e.grad, f"{name} step {step} d{param_name}")
        for optimizer in optimizers:
            optimizer.step()
    assert twin.rnn.last_backend == expected_eager_backend(name, backend, training=True)
    # the Function's forward and backward bodies are subgraphs of the one graph
    assert rnnkit_ops(recorder.ops()) == {FUSED_FORWARD, FUSED_BACKWARD}
    assert not recurrent_aten_ops(recorder.ops())


def test_compile_reference_backend_matches_eager():
    """The reference backend compiles too (its loop unrolled; T kept small: Inductor is slow on it)."""
    model = make_model("gru", "reference")
    tokens, _ = inputs("gru", steps=3)
    with torch.no_grad():
        expected = outputs_of(model(tokens))
    torch._dynamo.reset()
    recorder = RecordingInductor()
    with torch.no_grad():
        actual = outputs_of(torch.compile(model, fullgraph=True, backend=recorder)(tokens))
    assert_close(actual, expected, "reference compiled")
    assert not rnnkit_ops(recorder.ops())


@pytest.mark.parametrize("name, backend", [("lstm_peephole_ln", "fused"), ("lstm_bidir2_lengths", "auto")],
                         ids=["lstm_peephole_ln-fused", "lstm_bidir2_lengths-auto"])
def test_compile_dynamic_compiles_once(name, backend):
    """dynamic=True over T and B: three (T, B) shapes, one compilation, each matching eager."""
    model = make_model(name, backend).eval()
    torch._dynamo.reset()
    recorder = RecordingInductor()
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=recorder)
    for steps, batch in ((3, 2), (6, 4), (9, 3)):
        tokens, lengths = inputs(name, steps, batch)
        with torch.no_grad():
            assert_close(outputs_of(compiled(tokens, lengths)), outputs_of(model(tokens, lengths)),
                         f"{name} T={steps} B={batch}")
    assert recorder.compilations == 1, f"compiled {recorder.compilations} times for 3 shapes"


def test_compile_counter_sees_a_recompile():
    """The counting above would catch a recompile: without dynamic=True a second shape recompiles."""
    model = make_model("lstm", "fused").eval()
    torch._dynamo.reset()
    recorder = RecordingEager()
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend=recorder)
    with torch.no_grad():
        for steps in (3, 6):
            compiled(*inputs("lstm", steps))
    assert recorder.compilations == 2


FIRST_USE_SCRIPT = textwrap.dedent("""
    import json, warnings
    import torch, rnnkit
    from rnnkit.fused import build

    graphs = []
    def counting(gm, example_inputs):  # non-empty graphs: see RecordingInductor.compilations
        if any(node.op == "call_function" for node in gm.graph.nodes):
            graphs.append(gm)
        return gm.forward

    loaded_before = build.loaded() is not None
    torch.manual_seed(0)
    layer = rnnkit.LSTM(4, 8, peephole=True).eval()
    compiled = torch.compile(lambda x: layer(x)[0], fullgraph=True, dynamic=True, backend=counting)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for steps, batch in ((3, 2), (6, 4), (9, 3)):
            compiled(torch.randn(steps, batch, 4))
    about_rnnkit = [w for w in caught if "rnnkit" in w.filename or "rnnkit" in str(w.message)]
    print(json.dumps({"loaded_before": loaded_before, "compilations": len(graphs),
                      "warnings": [f"{w.filename}:{w.lineno}: {w.message}" for w in about_rnnkit]}))
""")


@pytest.fixture(scope="module")
def first_use_in_fresh_process():
    """What a user's first compile in a new process sees: compilations and warnings, as JSON."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", FIRST_USE_SCRIPT], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_compile_dynamic_first_use_in_fresh_process_compiles_once(first_use_in_fresh_process):
    """In a new process (the fused kernels not loaded yet) dynamic=True still compiles once for 3 shapes."""
    report = first_use_in_fresh_process
    assert not report["loaded_before"]
    assert report["compilations"] == 1, report


def test_compile_warns_nothing(first_use_in_fresh_process):
    """Compiling an rnnkit model shows the user no warning about rnnkit's code (Dynamo's own about
    it included)."""
    assert first_use_in_fresh_process["warnings"] == []


@pytest.mark.parametrize("name", ["lstm", "gru"])
def test_compile_named_native_backend_refuses_clearly(name):
    """backend='native' asked for by name is not silently replaced: under torch.compile it raises
    BackendUnavailableError saying why (torch.compile) and what traces instead (fused)."""
    model = make_model(name, "native")
    torch._dynamo.reset()
    with pytest.raises(rnnkit.BackendUnavailableError, match=r"backend='native'.*torch\.compile.*fused"):
        torch.compile(model)(*inputs(name))


# ---- 2. torch.export and AOTInductor -----------------------------------------------------------

def export(model, tokens, lengths, dynamic_T=True):
    """torch.export.export of the model with Dim B (and Dim T unless ``dynamic_T`` is False)."""
    steps, batch = Dim("T", min=2, max=64), Dim("B", min=2, max=64)
    token_dims = {0: steps, 1: batch} if dynamic_T else {1: batch}
    if lengths is None:
        return torch.export.export(model, (tokens,), dynamic_shapes=(token_dims,))
    return torch.export.export(model, (tokens, lengths), dynamic_shapes=(token_dims, {0: batch}))


@pytest.mark.parametrize("name, backend", CASES, ids=CASE_IDS)
def test_export_dynamic_matches_eager(name, backend):
    """torch.export with dynamic T and B; the program runs new shapes and matches eager (the fused
    op is in the graph, auto included)."""
    model = make_model(name, backend).eval()
    program = export(model, *inputs(name))
    ops = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert rnnkit_ops(ops) == {FUSED_FORWARD} and not recurrent_aten_ops(ops)
    for steps, batch in ((7, 4), (2, 2)):
        tokens, lengths = inputs(name, steps, batch, seed=steps)
        args = (tokens,) if lengths is None else (tokens, lengths)
        with torch.no_grad():
            assert_close(outputs_of(program.module()(*args)), outputs_of(model(tokens, lengths)),
                         f"{name} exported T={steps} B={batch}")


def test_an_exported_program_is_for_inference():
    """An exported program's rnnkit ops keep no activations (as the README says): a backward through
    one raises, saying so, rather than run without them."""
    torch.manual_seed(0)
    lstm = rnnkit.LSTM(INPUT, HIDDEN, peephole=True)
    program = torch.export.export(lstm, (torch.randn(5, 3, INPUT),),
                                  dynamic_shapes=({0: Dim("T", min=2), 1: Dim("B", min=2)},))
    x = torch.randn(6, 2, INPUT, requires_grad=True)
    y = program.module()(x)[0]
    with pytest.raises(RuntimeError, match="torch.export program are for inference"):
        y.sum().backward()


def test_export_reference_backend_dynamic_batch():
    """The reference backend exports with a dynamic batch (T stays static: it is a Python loop over
    time, which torch.export unrolls, so Dim T is refused as specialized)."""
    model = make_model("lstm_peephole_ln", "reference").eval()
    tokens, lengths = inputs("lstm_peephole_ln")
    program = export(model, tokens, lengths, dynamic_T=False)
    tokens, lengths = inputs("lstm_peephole_ln", T, 5, seed=7)
    with torch.no_grad():
        assert_close(outputs_of(program.module()(tokens, lengths)), outputs_of(model(tokens, lengths)), "reference")
    with pytest.raises(Exception, match="specialized"):
        export(model, tokens, lengths, dynamic_T=True)


AOTI_SCRIPT = textwrap.dedent("""
    import sys
    import torch, rnnkit
    from helpers import assert_close

    package, data = sys.argv[1:3]
    runner = torch._inductor.aoti_load_package(package)
    cases = torch.load(data)
    for k, (tokens, lengths, expected) in enumerate(cases):
        out = runner(tokens, lengths)
        flat = [out[0]] + [t for part in out[1] for t in (part if isinstance(part, (list, tuple)) else [part])]
        assert_close(flat, expected, f"AOTInductor case {k}")
    print("ok", len(cases))
""")


def test_aoti_package_loads_in_fresh_process(tmp_path):
    """An AOTInductor package of the exported model (dynamic T, B) loads in a new process that
    imports rnnkit, and matches eager on new shapes."""
    name = "lstm_bidir2_lengths"
    model = make_model(name, "auto").eval()
    program = export(model, *inputs(name))
    package = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "model.pt2"))
    cases = []
    for steps, batch in ((7, 4), (3, 2)):
        tokens, lengths = inputs(name, steps, batch, seed=steps)
        with torch.no_grad():
            cases.append((tokens, lengths, outputs_of(model(tokens, lengths))))
    torch.save(cases, tmp_path / "cases.pt")
    tests = str(Path(__file__).parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, tests, os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", AOTI_SCRIPT, package, str(tmp_path / "cases.pt")],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["ok", "2"]


# ---- 3. torch.func -----------------------------------------------------------------------------

FUNC_CASES = CASES + [(name, "reference") for name in CONFIGS] + [(name, "native") for name in PLAIN]
FUNC_IDS = [f"{name}-{backend}" for name, backend in FUNC_CASES]


@pytest.mark.parametrize("name, backend", FUNC_CASES, ids=FUNC_IDS)
def test_func_grad_of_functional_call_matches_autograd(name, backend):
    """torch.func.grad of a loss through functional_call equals autograd's gradients, parameter by
    parameter (the parameters passed in are fresh tensors, not the module's)."""
    model = make_model(name, backend)
    tokens, lengths = inputs(name)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    if backend == "native":  # torch's RNN ops have no torch.func rules: a named native backend refuses
        with pytest.raises(rnnkit.BackendUnavailableError, match="torch.func"):
            grad(lambda p: loss_of(functional_call(model, p, (tokens, lengths))))(params)
        return
    with warnings.catch_warnings():  # swapping parameters in for one call is not "broken aliasing"
        warnings.filterwarnings("error", message=".*packed buffer.*")
        grads = grad(lambda p: loss_of(functional_call(model, p, (tokens, lengths))))(params)
    expected = torch.autograd.grad(loss_of(model(tokens, lengths)), list(model.parameters()))
    for (key, _), e in zip(model.named_parameters(), expected):
        assert_close(grads[key], e, f"{name} d{key}")


def _clear_vmap_error(error: Exception, name, backend) -> None:
    """The rule for a case vmap cannot run: the error names vmap. The fused ops have vmap rules and
    the reference is plain torch: those two must run."""
    if backend in ("fused", "reference"):
        raise error
    assert "vmap" in str(error), (f"{name}-{backend}: vmap failed with an error that does not name vmap: "
                                  f"{type(error).__name__}: {error}")


@pytest.mark.parametrize("name, backend", FUNC_CASES, ids=FUNC_IDS)
def test_vmap_over_input(name, backend):
    """vmap over a leading batch of inputs equals a Python loop (or raises an error naming vmap)."""
    model = make_model(name, backend).eval()
    layer = model.rnn
    lengths = LENGTHS if CONFIGS[name][1] else None
    xs = torch.randn(3, T, B, INPUT)
    expected = torch.stack([layer(x, None, lengths)[0] for x in xs])
    try:
        actual = vmap(lambda x: layer(x, None, lengths)[0])(xs)
    except Exception as error:  # noqa: BLE001 (the rule is about the message)
        _clear_vmap_error(error, name, backend)
        return
    assert_close(actual, expected, f"{name} vmap over input")


@pytest.mark.parametrize("name, backend", FUNC_CASES, ids=FUNC_IDS)
def test_vmap_over_stacked_ensemble(name, backend):
    """An ensemble of 3 models (stack_module_state + functional_call on a meta copy) under vmap
    equals running each (or raises an error naming vmap)."""
    factory = CONFIGS[name][0]
    torch.manual_seed(3)
    members = [factory(backend=backend).eval() for _ in range(3)]
    params, buffers = stack_module_state(members)
    base = copy.deepcopy(members[0]).to("meta")
    lengths = LENGTHS if CONFIGS[name][1] else None
    x = torch.randn(T, B, INPUT)
    expected = torch.stack([m(x, None, lengths)[0] for m in members]).detach()
    try:
        actual = vmap(lambda p, b: functional_call(base, (p, b), (x, None, lengths))[0])(params, buffers)
    except Exception as error:  # noqa: BLE001
        _clear_vmap_error(error, name, backend)
        return
    assert_close(actual, expected, f"{name} vmap over an ensemble")


@pytest.mark.parametrize("backend", ["auto", "fused", "reference"])
@pytest.mark.parametrize("option", [dict(recurrent_dropout=0.3), dict(input_dropout=0.3), dict(dropconnect=0.3),
                                    dict(zoneout=0.3), dict(num_layers=2, dropout=0.3)],
                         ids=["recurrent_dropout", "input_dropout", "dropconnect", "zoneout", "dropout"])
def test_vmap_ensemble_in_training_draws_each_members_masks(backend, option):
    """vmap(randomness="different") over an ensemble in training refused every regularizer
    ("Cannot ask for different inplace randomness on an unbatched tensor"), where torch.nn's
    Dropout works: masks are drawn out of place under vmap. Members with equal weights get
    different masks with "different", the same with "same"."""
    member = rnnkit.GRU(INPUT, HIDDEN, backend=backend, **option).train()
    params, buffers = stack_module_state([member, copy.deepcopy(member)])
    base = copy.deepcopy(member).to("meta")
    x = torch.randn(T, B, INPUT)
    run = lambda p, b: functional_call(base, (p, b), (x,))[0]  # noqa: E731
    different = vmap(run, randomness="different")(params, buffers)
    assert different.shape == (2, T, B, HIDDEN) and torch.isfinite(different).all()
    assert (different[0] - different[1]).abs().max() > 1e-3
    same = vmap(run, randomness="same")(params, buffers)
    assert_close(same[0], same[1])


# ---- 4. torch.onnx.export of the whole model ---------------------------------------------------

ONNX_CASES = {  # name -> (layer, with lengths)
    "lstm_lengths": (lambda: rnnkit.LSTM(INPUT, HIDDEN), True),
    "lstm_peephole_coupled": (lambda: rnnkit.LSTM(INPUT, HIDDEN, peephole=True, coupled_gates=True), True),
    "lstm_bidir2": (lambda: rnnkit.LSTM(INPUT, HIDDEN, num_layers=2, bidirectional=True), True),
    "gru_reset_after": (lambda: rnnkit.GRU(INPUT, HIDDEN), False),
    "gru_reset_before": (lambda: rnnkit.GRU(INPUT, HIDDEN, reset_after=False), True),
    "rnn_relu": (lambda: rnnkit.RNN(INPUT, HIDDEN, nonlinearity="relu"), True),
    "gru_bidir_sum": (lambda: rnnkit.GRU(INPUT, HIDDEN, bidirectional=True, merge="sum"), False),
}
ONNX_NODE = {rnnkit.LSTM: "LSTM", rnnkit.GRU: "GRU", rnnkit.RNN: "RNN"}


def onnx_export(model, args):
    batch = Dim("B", min=2, max=64)
    dims = ({0: Dim("T", min=2, max=64), 1: batch},) + (({0: batch},) if len(args) == 2 else ())
    return torch.onnx.export(model, args, dynamo=True, dynamic_shapes=dims, verbose=False)


@pytest.mark.parametrize("case", list(ONNX_CASES))
def test_onnx_export_runs_in_onnxruntime(case):
    """torch.onnx.export(model, dynamo=True, dynamic T and B) -> standard LSTM / GRU / RNN nodes, one
    per layer-direction and nothing custom; onnxruntime on a new shape matches eager (logits and
    final states)."""
    import onnxruntime

    factory, with_lengths = ONNX_CASES[case]
    torch.manual_seed(0)
    model = Model(factory()).eval()
    tokens = torch.randint(0, VOCAB, (T, B))
    args = (tokens, LENGTHS) if with_lengths else (tokens,)
    proto = onnx_export(model, args).model_proto
    spec = model.rnn.spec
    nodes = [node.op_type for node in proto.graph.node]
    assert nodes.count(ONNX_NODE[type(model.rnn)]) == spec.num_layers * spec.num_directions, nodes
    assert {node.domain for node in proto.graph.node} <= {"", "ai.onnx"}, "a non-standard ONNX domain"
    assert not proto.functions, [f.name for f in proto.functions]
    session = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    tokens, lengths = torch.randint(0, VOCAB, (7, 4)), torch.tensor([7, 1, 3, 6])
    feeds = dict(zip([i.name for i in session.get_inputs()], [tokens.numpy(), lengths.numpy()]))
    actual = [torch.from_numpy(a) for a in session.run(None, feeds)]
    with torch.no_grad():
        expected = outputs_of(model(tokens, lengths if with_lengths else None))
    assert_close(actual, expected, f"{case} onnxruntime")


ONNX_REFUSED = {
    "layer_norm": lambda: rnnkit.LSTM(INPUT, HIDDEN, layer_norm=True),
    "proj_size": lambda: rnnkit.LSTM(INPUT, HIDDEN, proj_size=5),
    "zoneout": lambda: rnnkit.GRU(INPUT, HIDDEN, zoneout=0.1),
    "cell_clip": lambda: rnnkit.LSTM(INPUT, HIDDEN, cell_clip=3.0),
}


@pytest.mark.parametrize("option", list(ONNX_REFUSED))
def test_onnx_export_refuses_what_onnx_cannot_express(option):
    """A layer ONNX's recurrent operators cannot express fails the export with rnnkit's ValueError
    naming the option. torch.onnx.export (dynamo=True) wraps every exception of the export in its
    own OnnxExporterError (torch/onnx/_internal/exporter/_core.py), so the ValueError is found
    in the exception chain, and the message the user reads names the option too."""
    torch.manual_seed(0)
    model = Model(ONNX_REFUSED[option]()).eval()
    with pytest.raises(torch.onnx.OnnxExporterError) as info:
        onnx_export(model, (torch.randint(0, VOCAB, (T, B)),))
    assert option in str(info.value)
    chain, error = [], info.value
    while error is not None:
        chain.append(error)
        error = error.__cause__
    rnnkit_errors = [e for e in chain if isinstance(e, ValueError)]
    assert rnnkit_errors and str(rnnkit_errors[-1]).startswith(f"torch.onnx.export: {option}")


@pytest.mark.parametrize("cell", [lambda: rnnkit.LSTMCell(INPUT, HIDDEN, proj_size=4),
                                  lambda: rnnkit.GRUCell(INPUT, HIDDEN, layer_norm=True),
                                  lambda: rnnkit.LSTMCell(INPUT, HIDDEN, zoneout=0.1)],
                         ids=["lstm_cell-proj_size", "gru_cell-layer_norm", "lstm_cell-zoneout"])
def test_onnx_export_of_a_cell_refuses_with_rnnkits_error_as_the_cause(cell):
    """A cell ONNX cannot express is refused where it is called, as a stack is: rnnkit's ValueError,
    naming the option, is the exporter's error's own cause (not buried under the op's translation)."""
    with pytest.raises(torch.onnx.OnnxExporterError) as info:
        onnx_export(cell().eval(), (torch.randn(3, INPUT),))
    cause = info.value.__cause__
    assert isinstance(cause, ValueError) and str(cause).startswith("torch.onnx.export: "), repr(cause)


@pytest.mark.parametrize("option", [dict(num_layers=2, dropout=0.3), dict(input_dropout=0.3), dict(dropconnect=0.3),
                                    dict(recurrent_dropout=0.3)],
                         ids=["dropout", "input_dropout", "dropconnect", "recurrent_dropout"])
def test_onnx_export_in_training_mode_is_refused_for_every_dropout(option):
    """A model left in training mode exported with dropout, input_dropout or DropConnect masks
    drawn in the graph (recurrent_dropout was already refused): onnxruntime's outputs changed at
    every run."""
    model = Model(rnnkit.GRU(INPUT, HIDDEN, **option)).train()
    name = next(iter(k for k in option if k != "num_layers"))
    with pytest.raises(torch.onnx.OnnxExporterError, match=rf"{name} draws random masks .* evaluation mode"):
        onnx_export(model, (torch.randint(0, VOCAB, (T, B)),))


def test_onnx_export_in_training_mode_of_a_one_layer_dropout_is_taken():
    """dropout acts between layers: a one-layer stack draws no mask, so nothing is random."""
    with pytest.warns(UserWarning, match="dropout > 0 acts only between layers"):
        layer = rnnkit.GRU(INPUT, HIDDEN, dropout=0.3)
    onnx_export(Model(layer).train(), (torch.randint(0, VOCAB, (T, B)),))


# ---- 5. autocast -------------------------------------------------------------------------------

AUTOCAST_CONFIGS = {
    "lstm": lambda **kw: rnnkit.LSTM(INPUT, HIDDEN, **kw),
    "lstm_peephole_ln": lambda **kw: rnnkit.LSTM(INPUT, HIDDEN, peephole=True, layer_norm=True, **kw),
    "lstm_zoneout_eval": lambda **kw: rnnkit.LSTM(INPUT, HIDDEN, zoneout=(0.2, 0.1), **kw),
    "lstm_proj": lambda **kw: rnnkit.LSTM(INPUT, HIDDEN, proj_size=5, **kw),
    "gru": lambda **kw: rnnkit.GRU(INPUT, HIDDEN, **kw),
    "rnn": lambda **kw: rnnkit.RNN(INPUT, HIDDEN, **kw),
    "lstm_bidir2_lengths": lambda **kw: rnnkit.LSTM(INPUT, HIDDEN, num_layers=2, bidirectional=True, **kw),
}
AUTOCAST_CASES = [(name, backend) for name in AUTOCAST_CONFIGS for backend in ("auto", "fused", "reference")]

# bfloat16 keeps 8 significant bits: each rounding is off by up to 2^-9 relative. The fused kernels
# round only what they hand back (y per layer, the final states) and the reference rounds every
# step, so against the float32 run on the same bf16-rounded inputs and weights the relative RMS
# error is a few roundings (measured 1.5e-3 fused, up to 6e-3 reference at T=6). The one table's
# bfloat16 entry, 2e-2 (about ten roundings), is the bound; a silent float32 computation is caught
# by the dtype checks, not by this tolerance.
BF16 = TOLERANCE[torch.bfloat16]


def rounded_to_bf16(tree):
    if isinstance(tree, (list, tuple)):
        return type(tree)(rounded_to_bf16(t) for t in tree)
    return tree if tree is None else tree.to(torch.bfloat16).float()


@pytest.mark.parametrize("name, backend", AUTOCAST_CASES, ids=[f"{n}-{b}" for n, b in AUTOCAST_CASES])
def test_autocast_bf16_policy(name, backend):
    """Under torch.autocast("cpu", bfloat16) a float32 layer computes in bf16 whatever its variant
    and backend: y and the final states are bf16, close to the float32 run on bf16-rounded inputs
    and weights; the bf16 final state carries into the next call."""
    torch.manual_seed(0)
    layer = AUTOCAST_CONFIGS[name](backend=backend).eval()
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        for p in twin.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    x1, x2 = torch.randn(6, B, INPUT), torch.randn(4, B, INPUT)
    lengths = torch.tensor([6, 2, 4]) if "lengths" in name else None
    with torch.no_grad():
        with torch.autocast("cpu", torch.bfloat16):
            y1, h1 = layer(x1, None, lengths)
            y2, h2 = layer(x2, h1, None)  # the bf16 state carried on
        e1, g1 = twin(rounded_to_bf16(x1), None, lengths)
        e2, g2 = twin(rounded_to_bf16(x2), rounded_to_bf16(h1), None)
    for k, t in enumerate([y1] + flatten(h1) + [y2] + flatten(h2)):
        assert t.dtype == torch.bfloat16, f"{name}-{backend}: output {k} is {t.dtype}, not bfloat16"
    # auto: native only where oneDNN has a bf16 RNN kernel (CPUs with bf16 instructions), else fused
    assert layer.last_backend == backend or (backend == "auto" and layer.last_backend in ("native", "fused"))
    assert_close([y1] + flatten(h1), [e1] + flatten(g1), f"{name} first call", tol=BF16)
    assert_close([y2] + flatten(h2), [e2] + flatten(g2), f"{name} carried state", tol=BF16)


@pytest.mark.parametrize("name", list(AUTOCAST_CONFIGS))
def test_autocast_bf16_training_gradients(name):
    """With gradients under autocast the stack still computes in bf16, and the float32 parameters
    get float32 gradients, close to the float32 run's on bf16-rounded weights (bf16 bound)."""
    torch.manual_seed(0)
    layer = AUTOCAST_CONFIGS[name](backend="fused").eval()
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        for p in twin.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    x = torch.randn(6, B, INPUT)
    lengths = torch.tensor([6, 2, 4]) if "lengths" in name else None
    with torch.autocast("cpu", torch.bfloat16):
        y, hy = layer(x, None, lengths)
    assert y.dtype == torch.bfloat16
    g = upstream([y])[0].to(torch.bfloat16).float()
    (y.float() * g).sum().backward()
    ye, _ = twin(rounded_to_bf16(x), None, lengths)
    (ye * g).sum().backward()
    for (key, p), q in zip(layer.named_parameters(), twin.parameters()):
        assert p.grad is not None and p.grad.dtype == torch.float32, key
        assert_close(p.grad, q.grad, f"{name} d{key}", tol=BF16)



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["lstm", "gru_cell"])
def test_autocast_takes_float32_inputs_of_a_module_already_in_its_dtype(kind, dtype):
    """A module already in the autocast dtype takes float32 inputs and states under autocast, cast
    to that dtype as torch.nn's LSTM does (they were refused as "expected dtype bfloat16"): the
    same bits as calling it with inputs of its own dtype."""
    torch.manual_seed(0)
    layer = (rnnkit.LSTM(INPUT, 8, peephole=True) if kind == "lstm" else rnnkit.GRUCell(INPUT, 8)).to(dtype).eval()
    x = torch.randn(5, B, INPUT) if kind == "lstm" else torch.randn(B, INPUT)
    h = torch.randn(1, B, 8) if kind == "lstm" else torch.randn(B, 8)
    state = (h, torch.randn(1, B, 8)) if kind == "lstm" else h
    first = lambda out: out[0] if isinstance(out, tuple) else out  # noqa: E731
    for recording in (False, True):
        with torch.set_grad_enabled(recording):
            with torch.autocast("cpu", dtype):
                got = first(layer(x, state))
            want = first(layer(x.to(dtype), map_tree(state, lambda t: t.to(dtype))))
        assert got.dtype == dtype and torch.equal(got, want), (kind, recording)


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn", "lstm_cell", "gru_cell"])
@pytest.mark.parametrize("module_dtype, autocast_dtype", [(torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16),
                                                          (torch.float64, torch.bfloat16)], ids=["fp16-in-bf16", "bf16-in-fp16", "fp64-in-bf16"])
def test_autocast_leaves_a_module_of_another_dtype_alone(kind, backend, module_dtype, autocast_dtype):
    """A module in a half dtype other than autocast's (or float64) is left alone, as the policy
    says: the same bits in its own dtype as without autocast, gradients included. A float16 stack
    under bfloat16 autocast failed in torch.stack ("Unexpected floating ScalarType in
    at::autocast::prioritize"), and on the reference loop its products ran in bfloat16 and came
    back float32."""
    torch.manual_seed(0)
    build = {"lstm": rnnkit.LSTM, "gru": rnnkit.GRU, "rnn": rnnkit.RNN, "lstm_cell": rnnkit.LSTMCell,
             "gru_cell": rnnkit.GRUCell}[kind]
    layer = build(INPUT, 8, backend=backend).to(module_dtype)
    cell = kind.endswith("cell")
    x = torch.randn(B, INPUT) if cell else torch.randn(5, B, INPUT)
    flat = lambda out: flatten(out) if isinstance(out, tuple) else [out]  # noqa: E731
    runs = []
    for autocast in (False, True):
        inputs = x.to(module_dtype).requires_grad_()
        with torch.autocast("cpu", autocast_dtype, enabled=autocast):
            out = flat(layer(inputs))
        layer.zero_grad()
        sum((o.float() * (k + 1)).sum() for k, o in enumerate(out)).backward()
        runs.append((out, inputs.grad, [p.grad.clone() for p in layer.parameters()]))
    (plain, dx, dw), (cast, dx_cast, dw_cast) = runs
    assert [t.dtype for t in cast] == [module_dtype] * len(cast)
    assert all(torch.equal(a, b) for a, b in zip(plain + [dx] + dw, cast + [dx_cast] + dw_cast)), (kind, backend)


@pytest.mark.parametrize("wrong", ["input", "state"])
@pytest.mark.parametrize("kind", ["lstm", "gru_cell"])
def test_autocast_refuses_float64_naming_its_dtype(kind, wrong):
    """Under autocast a float64 input or state is refused (as torch.nn's LSTM refuses it: its
    bf16-cast weights meet the float64 input, which autocast leaves alone), with what came and
    what is taken: float32 or the autocast dtype. It said "expected dtype torch.bfloat16 (the dtype
    of the weights)", of float32 weights."""
    layer = rnnkit.LSTM(INPUT, 8) if kind == "lstm" else rnnkit.GRUCell(INPUT, 8)
    x = torch.randn(5, B, INPUT) if kind == "lstm" else torch.randn(B, INPUT)
    h = torch.randn(1, B, 8) if kind == "lstm" else torch.randn(B, 8)
    state = (h, torch.randn(1, B, 8)) if kind == "lstm" else h
    if wrong == "input":
        x = x.double()
    else:
        state = map_tree(state, torch.Tensor.double)
    name = "input" if wrong == "input" else ("hx[0] (h_0)" if kind == "lstm" else "hx (h)")
    expected = (f"{name}: expected dtype torch.float32 or torch.bfloat16 under torch.autocast('cpu', "
                "dtype=torch.bfloat16), got torch.float64")
    with torch.autocast("cpu", torch.bfloat16), pytest.raises(TypeError) as error:
        layer(x, state)
    assert str(error.value) == expected
    with torch.autocast("cpu", torch.bfloat16), pytest.raises(RuntimeError, match="same dtype"):
        torch.nn.LSTM(INPUT, 8)(torch.randn(5, B, INPUT, dtype=torch.float64))


# ---- 6. the step API against torch.nn's cells --------------------------------------------------

CELLS = {
    "lstm": (rnnkit.LSTMCell, torch.nn.LSTMCell, {}),
    "gru": (rnnkit.GRUCell, torch.nn.GRUCell, {}),
    "rnn_tanh": (rnnkit.RNNCell, torch.nn.RNNCell, {}),
    "rnn_relu": (rnnkit.RNNCell, torch.nn.RNNCell, {"nonlinearity": "relu"}),
}
CELL_CASES = [(kind, backend) for kind in CELLS for backend in ("auto", "fused", "native", "reference")]
CELL_IDS = [f"{k}-{b}" for k, b in CELL_CASES]


def cell_pair(kind, backend, size):
    """(torch.nn cell, rnnkit cell with torch.nn's state_dict loaded after a first call)."""
    ours, theirs, extra = CELLS[kind]
    torch.manual_seed(0)
    reference = theirs(size, size, **extra)
    cell = ours(size, size, backend=backend, **extra)
    with torch.no_grad():
        cell(torch.randn(2, size))  # any plan built on the old weights must see the new ones
    cell.load_state_dict(reference.state_dict())
    return reference, cell


def hidden(state):
    return state[0] if isinstance(state, tuple) else state


@pytest.mark.parametrize("kind, backend", CELL_CASES, ids=CELL_IDS)
def test_cell_generation_loop_equals_torch_nn(kind, backend):
    """20 generation steps, each output fed back as the next input, no_grad: every step's h (and c)
    equals torch.nn's cell."""
    size = 6
    reference, cell = cell_pair(kind, backend, size)
    x = torch.randn(2, size)
    theirs = ours = None
    x_theirs = x_ours = x
    with torch.no_grad():
        for step in range(20):
            theirs, ours = reference(x_theirs, theirs), cell(x_ours, ours)
            assert_close(flatten(ours), flatten(theirs), f"{kind} step {step}")
            x_theirs, x_ours = hidden(theirs), hidden(ours)
    assert cell.last_backend == ("fused" if backend == "auto" else backend)


@pytest.mark.parametrize("kind, backend", CELL_CASES, ids=CELL_IDS)
def test_cell_loop_gradients_equal_torch_nn(kind, backend):
    """A 5-step loop with gradients: the states and the gradients of the input, the initial state
    and every weight equal torch.nn's (random upstream gradients on every step's h)."""
    size = 5
    reference, cell = cell_pair(kind, backend, size)
    x = torch.randn(5, 2, size, requires_grad=True)
    h0 = torch.randn(2, size, requires_grad=True)
    initial = (h0, torch.zeros(2, size)) if kind == "lstm" else h0
    results = []
    for module in (reference, cell):
        state, hs = initial, []
        for step in range(5):
            state = module(x[step], state)
            hs.append(hidden(state))
        loss = sum((h * g).sum() for h, g in zip(hs, upstream(hs)))
        results.append((hs, torch.autograd.grad(loss, [x, h0] + list(module.parameters()))))
    (hs_t, grads_t), (hs_o, grads_o) = results
    assert_close(hs_o, hs_t, f"{kind} states")
    for label, a, e in zip(["dx", "dh0"] + [n for n, _ in reference.named_parameters()], grads_o, grads_t):
        assert_close(a, e, f"{kind} {label}")


# ---- 7. the custom ops: opcheck and the fake implementation ------------------------------------

OP_CONFIGS = {
    "lstm": lambda: rnnkit.LSTM(4, 6),
    "lstm_peephole": lambda: rnnkit.LSTM(4, 6, peephole=True),
    "lstm_ln": lambda: rnnkit.LSTM(4, 6, layer_norm=True),
    "lstm_proj_clip": lambda: rnnkit.LSTM(4, 6, proj_size=3, proj_clip=0.5, cell_clip=1.0),
    "lstm_coupled_peephole": lambda: rnnkit.LSTM(4, 6, coupled_gates=True, peephole=True),
    "lstm_zoneout_recurrent_dropout": lambda: rnnkit.LSTM(4, 6, zoneout=(0.3, 0.2), recurrent_dropout=0.2),
    "gru_reset_after": lambda: rnnkit.GRU(4, 6),
    "gru_reset_before": lambda: rnnkit.GRU(4, 6, reset_after=False),
    "gru_ln": lambda: rnnkit.GRU(4, 6, layer_norm=True),
    "rnn_tanh": lambda: rnnkit.RNN(4, 6),
    "rnn_relu_ln": lambda: rnnkit.RNN(4, 6, nonlinearity="relu", layer_norm=True),
    "lstm_odd_input": lambda: rnnkit.LSTM(5, 6, peephole=True),
}


def forward_args(name, training, lengths=None, steps=4, batch=3, seed=0):
    """The fused forward op's arguments (schema order) for the first pass of a configuration; in
    training the masks (zoneout, recurrent dropout) are drawn as tensors."""
    torch.manual_seed(seed)
    layer = OP_CONFIGS[name]()
    spec, cell = layer.spec, layer.spec.cell(0)
    weights = layer.layout.all_pass_weights(layer.flat_weights.detach() + 0.1 * torch.randn(layer.layout.numel))[0]
    x = torch.randn(steps, batch, cell.input_size)
    h0 = torch.randn(batch, cell.output_size)
    c0 = torch.randn(batch, cell.hidden_size) if spec.mode == "lstm" else None
    masks = draw_pass(spec, cell, steps, batch, x, training).masks
    values = pass_values(pass_scalars(cell, False, masks), x, h0, c0, tuple(weights), mask_tensors(lengths, masks))
    return values + (training,)


def backward_args(forward_values):
    """The fused backward op's arguments after a training forward (random upstream gradients)."""
    y, h_n, c_n, saved = OPS.forward_op(*forward_values)
    dy, dh_n, dc_n = upstream([y, h_n, c_n], seed=4)
    c0 = forward_values[2]
    return forward_values[:-1] + (y, saved, dy, dh_n, dc_n if c0 is not None else None, True, True, True,
                                  forward_values[7] is not None)


OPCHECK_CASES = [  # (configuration, training, lengths)
    ("lstm_coupled_peephole", True, torch.tensor([4, 2, 3])),
    ("lstm_proj_clip", True, None),
    ("lstm_ln", True, torch.tensor([4, 1, 3])),
    ("gru_ln", True, None),
    ("gru_reset_before", True, torch.tensor([4, 1, 3])),
    ("rnn_relu_ln", False, torch.tensor([4, 1, 3])),
    ("lstm_zoneout_recurrent_dropout", True, None),
]
OPCHECK_IDS = [f"{n}-{'training' if t else 'inference'}-{'lengths' if l is not None else 'full'}"
               for n, t, l in OPCHECK_CASES]


@pytest.mark.parametrize("name, training, lengths", OPCHECK_CASES, ids=OPCHECK_IDS)
def test_opcheck_fused_forward_and_backward(name, training, lengths):
    """torch.library.opcheck on both ops: schema (no mutation or aliasing the schema does not say),
    autograd registration, fake vs real outputs, and eager vs AOT-dispatch tracing (which compares
    every output, the saved tensors included)."""
    values = forward_args(name, training, lengths)
    torch.library.opcheck(OPS.forward_op, values)
    if training:
        torch.library.opcheck(OPS.backward_op, backward_args(values))


HALF_CALL_CASES = [  # (configuration, lengths): masks, layer norm, projection and clips, both GRUs, the RNN
    ("lstm_zoneout_recurrent_dropout", None),
    ("lstm_ln", torch.tensor([4, 1, 3])),
    ("lstm_proj_clip", None),
    ("gru_reset_before", torch.tensor([4, 1, 3])),
    ("gru_ln", None),
    ("rnn_relu_ln", torch.tensor([2, 4, 1])),
    ("lstm_odd_input", None),  # an odd I: a bfloat16 x widened (the products take whole pairs as they are)
]


def half_call_args(name, lengths, dtype):
    """(a half-precision call's forward arguments: every float tensor in ``dtype``; the same call as
    the op took it before such calls, x, the states, the vectors and the masks in float32 holding
    the same values beside the matrices in ``dtype``)."""
    values = forward_args(name, True, lengths)
    matrices = {arg_index(n) for n in ("W", "R", "W_hr")}
    half = tuple(v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for v in values)
    widened = tuple(v if i in matrices or not (isinstance(v, torch.Tensor) and v.is_floating_point()) else v.float()
                    for i, v in enumerate(half))
    return half, widened


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name, lengths", HALF_CALL_CASES, ids=[n for n, _ in HALF_CALL_CASES])
def test_fused_half_call_equals_a_float32_call_rounded(name, lengths, dtype):
    """A half-precision call (x in its matrices' bfloat16 / float16, as a half module's passes call
    the op): its results are the float32 call's on the same values, rounded to x's dtype, bit for
    bit: y, h_n, c_n, and in the backward dx, dh0, dc0 and the weights' gradient block; it keeps its
    float32 y for the backward (the last saved slot), which reads that, not y's rounding. With the
    kernels' buffers NaN-poisoned: x's float32 buffer, filled only where something reads x in float32
    (the bfloat16 products take a bfloat16 x of even I as it is), is never read unfilled."""
    half, widened = half_call_args(name, lengths, dtype)
    build.set_poison(True)
    try:
        y, h_n, c_n, saved = OPS.forward_op(*half)
    finally:
        build.set_poison(False)
    y_f, h_f, c_f, saved_f = OPS.forward_op(*widened)
    for label, got, want in [("y", y, y_f), ("h_n", h_n, h_f), ("c_n", c_n, c_f)]:
        assert got.dtype == dtype, f"{label}: {got.dtype}"
        assert torch.equal(got, want.to(dtype)), label
    assert len(saved) == len(saved_f) == build.extension().saved_count()
    for k, (got, want) in enumerate(zip(saved[:-1], saved_f[:-1])):
        assert got.dtype == want.dtype and torch.equal(got, want), f"saved[{k}]"
    assert saved[-1].dtype == torch.float32 and torch.equal(saved[-1], y_f), "saved y"
    assert saved_f[-1].numel() == 0  # a float32 call keeps no second y

    dy, dh_n, dc_n = upstream([y_f, h_f, c_f], seed=4)
    tail = lambda y_, saved_, cast: (y_, saved_, cast(dy), cast(dh_n), cast(dc_n) if half[2] is not None else None,  # noqa: E731
                                     True, True, True, half[arg_index("W_hr")] is not None)
    build.set_poison(True)
    try:
        grads = OPS.backward_op(*half[:-1], *tail(y, saved, lambda t: t.to(dtype)))
    finally:
        build.set_poison(False)
    # the float32 call's upstream gradients: the half ones' values
    grads_f = OPS.backward_op(*widened[:-1], *tail(y_f, saved_f, lambda t: t.to(dtype).float()))
    for label, got, want in zip(["dx", "dh0", "dc0", "dweights"], grads, grads_f):
        assert got.dtype == dtype, f"{label}: {got.dtype}"
        assert torch.equal(got, want.to(dtype)), label


@pytest.mark.parametrize("name, lengths", HALF_CALL_CASES[:4], ids=[n for n, _ in HALF_CALL_CASES[:4]])
def test_opcheck_fused_half_call(name, lengths):
    """torch.library.opcheck on a bfloat16 call of both ops: the fake implementation's dtypes (results
    in x's, saved tensors in float32, the float32 y among them) and shapes agree with the kernels'."""
    half, _ = half_call_args(name, lengths, torch.bfloat16)
    torch.library.opcheck(OPS.forward_op, half)
    torch.library.opcheck(OPS.backward_op, backward_args(half))


@pytest.mark.parametrize("slot", ["h0", "c0", "recurrent_mask", "b_R", "ln_h_gain"])
def test_fused_half_call_refuses_a_tensor_in_another_dtype(slot):
    """A half-precision call takes every tensor in its matrices' dtype: a float32 state, mask or
    vector beside them is an error naming it (its gradient would come back rounded, and the fake
    implementation would give dh0 h0's dtype where the kernels give x's)."""
    name = "lstm_ln" if slot == "ln_h_gain" else "lstm_zoneout_recurrent_dropout"
    half = list(half_call_args(name, None, torch.bfloat16)[0])
    half[arg_index(slot)] = half[arg_index(slot)].float()
    with pytest.raises(RuntimeError, match=f"{slot}: expected BFloat16 like x and W .* got Float"):
        OPS.forward_op(*half)


@pytest.mark.parametrize("name", ["lstm_peephole", "gru"])
def test_bf16_fused_double_backward_recomputes_in_float32(name):
    """create_graph on a bfloat16 module's fused passes recomputes each pass with the reference
    backend in float32 on the module's values (passes._reference_backward): its first-order gradient
    and a gradient penalty's weight gradients agree with the float32 reference module's on the same
    values within bfloat16's tolerance (measured 2-5e-3: the fused forward's bfloat16 products and
    the roundings of y, the first-order gradient and the weights' gradients to bfloat16)."""
    from rnnkit.testing import assert_close
    torch.manual_seed(0)
    make = {"lstm_peephole": lambda **k: rnnkit.LSTM(4, 6, peephole=True, **k),
            "gru": lambda **k: rnnkit.GRU(4, 6, **k)}[name]
    half = make(backend="fused").bfloat16()
    reference = make(backend="reference")
    reference.load_state_dict({k: v.float() for k, v in half.state_dict().items()})
    x = torch.randn(7, 3, 4).bfloat16()
    results = []
    for layer, given in ((half, x.clone()), (reference, x.float())):
        given.requires_grad_(True)
        y, _ = layer(given)
        g, = torch.autograd.grad((y.float() ** 2).sum(), given, create_graph=True)
        grads = torch.autograd.grad((g.float() ** 2).sum(), list(layer.parameters()))
        assert g.dtype == given.dtype and all(p.dtype == given.dtype for p in grads)
        results.append([g, *grads])
    for (label, _), got, want in zip([("dx", None), *layer.named_parameters()], *results):
        assert_close(got.float(), want, f"{name} {label}", dtype=torch.bfloat16)


def test_fused_half_call_backward_needs_the_saved_y():
    """A half-precision call's backward given a saved list without the float32 y (a float32 call's)
    is an error naming it, not a backward on y's rounding."""
    half, widened = half_call_args("rnn_relu_ln", None, torch.bfloat16)
    values = backward_args(half)
    saved_f = OPS.forward_op(*widened)[3]
    with pytest.raises(RuntimeError, match=r"reads the float32 y its training forward saved"):
        OPS.backward_op(*values[:-8], saved_f, *values[-7:])


def arg_index(name: str) -> int:
    """The position of the fused forward op's argument ``name``, from its schema."""
    return [n.name for n in OPS.forward_op._schema.arguments].index(name)


@pytest.mark.parametrize("name, missing", [("lstm_ln", "ln_x_gain"), ("lstm_ln", "ln_c_shift"), ("gru_ln", "ln_h_shift"),
                                           ("rnn_relu_ln", "ln_x_shift")])
def test_fused_op_refuses_part_of_layer_norm(name, missing):
    """Called directly, the op takes layer norm as all of its gains and shifts or none: one left out
    is an error naming them (the passes would normalize with some and silently skip the rest)."""
    values = list(forward_args(name, False))
    values[arg_index(missing)] = None
    with pytest.raises(RuntimeError, match="layer norm needs the gains and shifts"):
        OPS.forward_op(*values)
    OPS.forward_op(*forward_args(name, False))  # all of them: runs


@pytest.mark.parametrize("name, other", [("lstm_ln", "ln_x_gain"), ("lstm_ln", "ln_x_shift"), ("lstm_ln", "ln_h_shift"),
                                         ("lstm_ln", "ln_c_gain"), ("gru_ln", "ln_x_shift"), ("rnn_relu_ln", "ln_x_gain")])
def test_fused_op_refuses_layer_norm_of_another_dtype(name, other):
    """Layer norm's gains and shifts are read as x's dtype (no per-row dtype check): one of another
    dtype is an error naming both dtypes, not float64 bits read as float32 nor ATen's generic
    message from wherever a pass first reads it."""
    values = list(forward_args(name, False))
    values[arg_index(other)] = values[arg_index(other)].double()
    with pytest.raises(RuntimeError, match="layer norm's gains and shifts: expected Float like x, got Double"):
        OPS.forward_op(*values)


def test_fused_op_refuses_cell_norm_without_layer_norm_and_reset_before_with_it():
    values = list(forward_args("lstm", False))
    values[arg_index("ln_c_gain")], values[arg_index("ln_c_shift")] = torch.ones(6), torch.zeros(6)
    with pytest.raises(RuntimeError, match="layer norm needs the gains and shifts"):
        OPS.forward_op(*values)
    values = list(forward_args("gru_ln", False))
    values[arg_index("reset_after")] = False
    with pytest.raises(RuntimeError, match="a layer-norm GRU needs reset_after"):
        OPS.forward_op(*values)


def tensor_meta(out):
    return [(tuple(t.shape), t.dtype) for t in out[:3]] + [[(tuple(t.shape), t.dtype) for t in out[3]]]


@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("name", list(OP_CONFIGS))
def test_fake_implementation_matches_real_shapes(name, training):
    """The fake forward returns what the real one does, shape and dtype: y, h_n, c_n and each saved
    tensor (the fake's saved list is what compile/export plan memory with). Backward too."""
    values = forward_args(name, training, torch.tensor([4, 1, 3]))
    real = OPS.forward_op(*values)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = OPS.forward_op(*[mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in values])
    assert tensor_meta(fake) == tensor_meta(real)
    if training:
        args = backward_args(values)
        real = OPS.backward_op(*args)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = OPS.backward_op(*[
                [mode.from_tensor(t) for t in v] if isinstance(v, list)
                else (mode.from_tensor(v) if isinstance(v, torch.Tensor) else v) for v in args])
        assert [(tuple(t.shape), t.dtype) for t in fake] == [(tuple(t.shape), t.dtype) for t in real]


@pytest.mark.parametrize("name", ["lstm_ln", "gru_reset_after", "rnn_tanh"])
def test_fused_forward_writes_every_output_element(name):
    """With the kernels' allocations NaN-poisoned, no returned tensor (y, h_n, c_n, saved) holds a
    NaN: an op's outputs are all written, also at steps past a sequence's length (else the op is
    not a function of its inputs, and opcheck's eager-vs-traced comparison fails at random)."""
    build.set_poison(True)
    try:
        y, h_n, c_n, saved = OPS.forward_op(*forward_args(name, True, torch.tensor([4, 1, 3])))
    finally:
        build.set_poison(False)
    for label, t in [("y", y), ("h_n", h_n), ("c_n", c_n)] + [(f"saved[{k}]", s) for k, s in enumerate(saved)]:
        if t.is_floating_point():
            unwritten = t.isnan()
            assert not unwritten.any(), (f"{name}: {label} {tuple(t.shape)} has {int(unwritten.sum())} unwritten "
                                         f"elements, e.g. at {unwritten.nonzero()[:3].tolist()}")


# ---- 8. double backward ------------------------------------------------------------------------

DOUBLE_CONFIGS = {
    "lstm": lambda **kw: rnnkit.LSTM(3, 5, **kw),
    "lstm_peephole_ln_bidir": lambda **kw: rnnkit.LSTM(3, 5, peephole=True, layer_norm=True, bidirectional=True,
                                                       **kw),
    "lstm_proj_2layer": lambda **kw: rnnkit.LSTM(3, 5, proj_size=2, num_layers=2, **kw),
    "lstm_zoneout_eval": lambda **kw: rnnkit.LSTM(3, 5, zoneout=0.2, **kw),
    "gru_reset_before": lambda **kw: rnnkit.GRU(3, 5, reset_after=False, **kw),
    "rnn_relu": lambda **kw: rnnkit.RNN(3, 5, nonlinearity="relu", **kw),
}


def second_order(name, backend, lengths):
    """(first-order gradients under create_graph, gradient-penalty gradients, Hessian-vector
    products, first-order gradients without create_graph) in float64."""
    torch.manual_seed(0)
    layer = DOUBLE_CONFIGS[name](backend=backend, dtype=torch.float64).eval()
    with torch.no_grad():
        layer.flat_weights.add_(0.1 * torch.randn_like(layer.flat_weights))
    x = torch.randn(4, 2, 3, dtype=torch.float64, requires_grad=True)
    params = list(layer.parameters())
    y, hy = layer(x, None, lengths)
    outs = [y] + flatten(hy)
    plain = torch.autograd.grad(outs, [x] + params, upstream(outs), retain_graph=True)
    first = torch.autograd.grad(outs, [x] + params, upstream(outs), create_graph=True)
    penalty = sum(g.square().sum() for g in first)
    penalty_grads = torch.autograd.grad(penalty, [x] + params, retain_graph=True)
    vectors = upstream(params, seed=9)
    hvp = torch.autograd.grad(first[1:], params, vectors)
    return first, penalty_grads, hvp, plain


DOUBLE_CASES = [(name, k % 2 == 1) for k, name in enumerate(DOUBLE_CONFIGS)]  # lengths on every other one


@pytest.mark.parametrize("name, with_lengths", DOUBLE_CASES,
                         ids=[f"{n}-{'lengths' if l else 'full'}" for n, l in DOUBLE_CASES])
def test_double_backward_fused_matches_reference(name, with_lengths):
    """create_graph=True on the fused backend, then a gradient penalty's gradient and a
    Hessian-vector product: equal to the reference backend's (float64); and the first-order
    gradients with and without create_graph agree (the C++ backward vs the recomputation)."""
    lengths = torch.tensor([4, 2]) if with_lengths else None
    fused, reference = second_order(name, "fused", lengths), second_order(name, "reference", lengths)
    for label, a, e in zip(("first order", "penalty gradient", "Hessian-vector product", "plain first order"),
                           fused, reference):
        assert_close(list(a), list(e), f"{name} {label}")
    assert_close(list(fused[3]), [g.detach() for g in fused[0]], f"{name} C++ backward vs create_graph")


@pytest.mark.parametrize("mode, options, output", [
    ("lstm", dict(peephole=True), "y"), ("lstm", {}, "h_n"), ("lstm", dict(layer_norm=True), "c_n"),
    ("gru", {}, "y"), ("rnn_tanh", {}, "h_n"),
])
def test_func_vjp_and_jacrev_on_fused_match_autograd(mode, options, output):
    """torch.func.vjp calls its vjp_fn after the forward's transform has exited (the saved tensors
    then wrap a dead level): its gradients, and jacrev's, equal autograd's (they were up to 0.3 off)."""
    torch.manual_seed(1)
    module = {"lstm": rnnkit.LSTM, "gru": rnnkit.GRU, "rnn_tanh": rnnkit.RNN}[mode](
        3, 4, backend="fused", dtype=torch.float64, **options).train()
    pick = {"y": lambda out: out[0], "h_n": lambda out: out[1][0] if mode == "lstm" else out[1],
            "c_n": lambda out: out[1][1]}[output]
    x0 = torch.randn(3, 2, 3, dtype=torch.float64)
    out, vjp_fn = torch.func.vjp(lambda x: pick(module(x)), x0)
    v = torch.randn_like(out)
    x = x0.clone().requires_grad_(True)
    expected = torch.autograd.grad(pick(module(x)), x, v)[0]
    assert_close(vjp_fn(v)[0], expected, "vjp")
    jacobian = torch.func.jacrev(lambda x: pick(module(x)))(x0)  # [*out, *x]
    assert_close(torch.tensordot(v, jacobian, dims=v.dim()), expected, "jacrev")


class _NoGradientToY(torch.autograd.Function):
    """w + 0·y whose backward sends y no gradient (None): autograd then hands the pass no gradient
    on any of its outputs."""

    @staticmethod
    def forward(ctx, y, w):
        return y.detach() * 0 + w

    @staticmethod
    def backward(ctx, g):
        return None, g.sum().reshape(())


@pytest.mark.parametrize("create_graph", [False, True])
def test_a_pass_that_receives_no_gradient_gives_zeros(create_graph):
    """The saved outputs' gradients are not materialized (zeros would cost a fill per output); a pass
    whose outputs all receive None still gives zero gradients, with and without create_graph."""
    layer = rnnkit.LSTM(3, 5, backend="fused", dtype=torch.float64)
    x = torch.randn(4, 2, 3, dtype=torch.float64, requires_grad=True)
    w = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
    y, _ = layer(x)
    dx, dw = torch.autograd.grad(_NoGradientToY.apply(y, w).sum(), [x, w], create_graph=create_graph)
    assert torch.equal(dx, torch.zeros_like(x)) and float(dw) == 4 * 2 * 5


def test_gradgradcheck_fused():
    """Second derivatives of the fused backend against finite differences (float64), through
    functional_call so every weight is an input."""
    torch.manual_seed(0)
    layer = rnnkit.LSTM(2, 3, peephole=True, backend="fused", dtype=torch.float64).eval()
    names = [n for n, _ in layer.named_parameters()]
    x = torch.randn(3, 2, 2, dtype=torch.float64, requires_grad=True)
    params = [p.detach().clone().requires_grad_() for p in layer.parameters()]

    def run(x, *ps):
        y, (h_n, c_n) = functional_call(layer, dict(zip(names, ps)), (x, None, torch.tensor([3, 2])))
        return y, h_n, c_n

    assert torch.autograd.gradgradcheck(run, (x, *params))


@pytest.mark.parametrize("name", ["lstm_peephole_ln_bidir", "gru_reset_before"])
def test_func_grad_of_grad_fused_matches_reference(name):
    """torch.func.grad of a function of torch.func.grad (second order through functorch) on the
    fused backend equals the reference backend's (float64)."""
    results = {}
    for backend in ("fused", "reference"):
        torch.manual_seed(0)
        layer = DOUBLE_CONFIGS[name](backend=backend, dtype=torch.float64).eval()
        x = torch.randn(4, 2, 3, dtype=torch.float64)

        def loss(x):
            return layer(x, None, torch.tensor([4, 2]))[0].square().sum()

        results[backend] = grad(lambda x: grad(loss)(x).square().sum())(x)
    assert_close(results["fused"], results["reference"], f"{name} grad of grad")


def test_torchscript_as_the_readme_says():
    """README: jit.script is not supported; jit.trace (check_trace=False) computes correctly at other T and B."""
    module = rnnkit.LSTM(4, 5).eval()
    with pytest.raises(Exception):
        torch.jit.script(module)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's warnings about Python values
        traced = torch.jit.trace(module, (torch.randn(3, 2, 4),), check_trace=False)
    x = torch.randn(6, 3, 4)
    assert torch.equal(traced(x)[0], module(x)[0])


@pytest.mark.parametrize("make", [lambda b: rnnkit.GRU(INPUT, HIDDEN, backend=b),
                                  lambda b: rnnkit.LSTM(INPUT, HIDDEN, peephole=True, layer_norm=True, backend=b)],
                         ids=["gru", "lstm_peephole_ln"])
def test_forward_mode_ad_runs_on_the_reference_backend(make):
    """jacfwd / jvp / forward_ad failed on 'auto' with "You must implement the jvp function"
    (the fused op has no jvp rule); 'auto' now picks a backend that has one, and a named fused
    backend says why it cannot."""
    import torch.autograd.forward_ad as fwAD

    module = make("auto").double().eval()
    x = torch.randn(3, 2, INPUT, dtype=torch.float64)
    forward = torch.func.jacfwd(lambda v: module(v)[0])(x)
    backward = torch.func.jacrev(lambda v: module(v)[0])(x)
    assert_close(forward, backward)
    tangent = torch.randn_like(x)
    with fwAD.dual_level():
        y = module(fwAD.make_dual(x, tangent))[0]
        assert_close(fwAD.unpack_dual(y).tangent, torch.einsum("tbhsci,sci->tbh", backward, tangent))
    fused = make("fused").double()
    with pytest.raises(rnnkit.BackendUnavailableError, match="forward-mode AD"):
        torch.func.jvp(lambda v: fused(v)[0], (x,), (tangent,))



def test_plain_half_precision_and_autocast_lstm_inference_compile_without_a_graph_break():
    """native's dtype probe (torch.ops.mkldnn._is_mkldnn_bf16_supported) ran before its
    is_compiling check: Dynamo stopped there on a plain bf16 / fp16 / autocast LSTM's inference."""
    x = torch.randn(T, B, INPUT)
    for dtype in (torch.bfloat16, torch.float16):
        module = rnnkit.LSTM(INPUT, HIDDEN).to(dtype).eval()
        with torch.no_grad():
            assert_close(torch.compile(module, fullgraph=True)(x.to(dtype))[0].float(), module(x.to(dtype))[0].float(),
                         dtype=dtype)  # eager runs oneDNN, compiled the fused op: each rounds its own way
    module = rnnkit.LSTM(INPUT, HIDDEN).eval()
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        assert_close(torch.compile(module, fullgraph=True)(x)[0].float(), module(x)[0].float(), dtype=torch.bfloat16)


def test_per_sample_lengths_under_vmap():
    """vmap over per-sample lengths failed with torch's .item() error in rnnkit's value check;
    now every sample's lengths are checked at once, and the gradients are each sample's."""
    module = rnnkit.LSTM(INPUT, HIDDEN).eval()
    params = {k: v.detach() for k, v in module.named_parameters()}
    x, lengths = torch.randn(T, B, INPUT), torch.tensor([T, 2, 3])

    def loss(p, xi, li):
        return functional_call(module, p, (xi.unsqueeze(1),), dict(lengths=li.unsqueeze(0)))[0].pow(2).sum()

    batched = vmap(grad(loss), in_dims=(None, 1, 0))(params, x, lengths)
    for i in range(B):
        one = grad(loss)(params, x[:, i], lengths[i])
        for name in params:
            assert_close(batched[name][i], one[name])
    with pytest.raises(ValueError, match=r"lengths: expected values in \[1, T=\d+\], got min 2, max 9"):
        vmap(grad(loss), in_dims=(None, 1, 0))(params, x, torch.tensor([T, 2, 9]))


def test_bad_lengths_under_compile_are_value_errors():
    """Under compile the kernels check the values (rnnkit's check would break the graph): their
    error is a ValueError too, as eager's."""
    module = torch.compile(rnnkit.LSTM(INPUT, HIDDEN).eval(), fullgraph=True, dynamic=True)
    with torch.no_grad(), pytest.raises(ValueError, match=r"lengths: expected values in \[1, T="):
        module(torch.randn(T, B, INPUT), lengths=torch.tensor([T + 2, 3, 2]))



@pytest.mark.parametrize("make", [lambda: rnnkit.LSTM(INPUT, HIDDEN), lambda: rnnkit.LSTM(INPUT, HIDDEN, zoneout=0.1),
                                  lambda: rnnkit.LSTMCell(INPUT, HIDDEN, proj_size=3)],
                         ids=["plain-lstm", "lstm-zoneout", "lstmcell-proj"])
@pytest.mark.parametrize("steps", [1, 3])
def test_forward_ad_tangents_after_a_plain_call(make, steps):
    """A plain float32 LSTM under forward_ad went to oneDNN (no forward-AD formula: an error), and
    after one no-grad call at T = 1 the cached one-step plan dropped the tangent silently."""
    import torch.autograd.forward_ad as fwAD

    module = make().eval()
    cell = isinstance(module, rnnkit.LSTMCell)
    x = torch.randn(B, INPUT) if cell else torch.randn(steps, B, INPUT)
    tangent = torch.randn_like(x)
    first = lambda v: module(v)[0]  # noqa: E731  (h, or y)
    with torch.no_grad():
        first(x)  # builds and caches the one-step plans
    expected = torch.func.jvp(first, (x,), (tangent,))[1]
    reference = make().eval()
    reference.load_state_dict(module.state_dict())
    reference.backend = "reference"
    assert_close(expected, torch.func.jvp(lambda v: reference(v)[0], (x,), (tangent,))[1])
    with fwAD.dual_level():
        dual = fwAD.unpack_dual(first(fwAD.make_dual(x, tangent))).tangent
    assert dual is not None
    assert_close(dual, expected)
    with torch.no_grad():
        assert_close(first(x), reference(x)[0])  # the plain path afterwards (plans not poisoned)
    quantized = rnnkit.quantize(module)
    with fwAD.dual_level(), pytest.raises(RuntimeError, match="int8 module is for inference"):
        quantized(fwAD.make_dual(x, tangent))


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_a_tensor_leaked_from_a_finished_transform_is_taken_as_its_value(backend):
    """An input that escaped a finished torch.func transform (a dead wrapper) goes through
    Function.apply's unwrapping, not the direct C++ apply plain tensors take (passes._plain): the
    call and its gradients are those of the plain tensor."""
    torch.manual_seed(0)
    layer = rnnkit.LSTM(3, 4, num_layers=2, backend=backend)
    plain = torch.randn(5, 2, 3)
    leaked = []
    torch.func.grad(lambda t: leaked.append(t) or t.sum())(plain.clone())
    assert torch._C._functorch.is_functorch_wrapped_tensor(leaked[0])
    grads = []
    for x in (plain, leaked[0]):
        layer.zero_grad()
        y, (h, c) = layer(x)
        loss_of((y, (h, c))).backward()
        grads.append([p.grad.clone() for p in layer.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
