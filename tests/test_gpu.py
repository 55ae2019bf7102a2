"""GPU checks (issue 16), and what keeps them from rotting on the CPU suite.

On every machine:
- benchmarks/gpu_correctness.py, the GPU correctness sweep, runs a few tiny cases on CPU tensors
  under Triton's interpreter (a subprocess: TRITON_INTERPRET must be set before triton is
  imported), and its comparison flags a wrong or NaN result;
- the detector the cuDNN tests rely on (ops run inside an op, from the profiler) sees a copy.

On CUDA only (skipped without a device):
- the native backend hands cuDNN the module's packed buffer: no per-call copy of the weights
  inside ``aten::_cudnn_rnn`` (cuDNN copies them into a buffer of its own, and warns, when the
  weights are not one buffer in its layout starting at the storage's first byte) and no re-flatten,
  for a module made on the GPU, after ``.to("cuda")``, after ``load_state_dict``, and wrapped in
  DistributedDataParallel (one process); rnnkit's layout is cuDNN's, as torch.nn's flattened
  buffer shows it;
- the triton backend's compiled kernels on a plain LSTM against the reference, with and without
  CUDA-graph replay (TRITON_INTERPRET=0: tests/conftest.py sets it to 1 unless it is set or
  RNNKIT_TEST_TRITON_DEVICE=cuda).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import rnnkit
from helpers import assert_close, make_module, run_backend

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ROOT / "benchmarks" / "gpu_correctness.py"
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")

# torch's message when cuDNN must copy the weights into a buffer of its own (aten/src/ATen/native/cudnn/RNN.cpp)
COPY_WARNING = "not part of single contiguous chunk of memory"
COPY_OPS = {"aten::copy_", "aten::zero_"}  # _cudnn_rnn without a weight buffer: zero_ a new one, copy_ each weight


def _sweep_module():
    spec = importlib.util.spec_from_file_location("gpu_correctness", SWEEP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- the sweep, on CPU under the interpreter ------------------------------------------------

def test_correctness_sweep_runs_under_the_interpreter():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "RNNKIT_TRITON_CUDA_GRAPHS"}
    env.update(TRITON_INTERPRET="1", RNNKIT_TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src")] + [p for p in [env.get("PYTHONPATH")] if p]))
    command = [sys.executable, str(SWEEP), "--tiny", "--device", "cpu", "--dtypes"]
    # one process per case, side by side (one thread each: the interpreter's time is the suite's
    # longest), each case in one dtype: a half dtype's bounds in inference, float32's in training
    # (both dtypes of both cases took 28 s; the kernels' own checks are tests/test_triton.py's)
    outs = _side_by_side([command + ["bfloat16", "--filter", "lstm-everything-eval"],
                          command + ["float32", "--filter", "gru-all-train"]], env)
    verdicts = sorted(line.split()[:3] for out in outs for line in out.stdout.splitlines() if line.startswith(("PASS", "FAIL")))
    assert verdicts == [["PASS", "gru-all-train", "float32"], ["PASS", "lstm-everything-eval", "bfloat16"]], outs
    assert all("1/1 passed, 0 failed" in out.stdout.splitlines()[-1] for out in outs), outs


def _side_by_side(commands, env) -> list:
    """Run ``commands`` at once (each its own process) -> their CompletedProcess-like results, each
    asserted to have exited 0."""
    processes = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for c in commands]
    outs = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=600)
        outs.append(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
    for out in outs:
        assert out.returncode == 0, out.stdout + out.stderr
    return outs


def test_profile_script_runs_under_the_interpreter():
    """benchmarks/gpu_profile.py (the next GPU session's first question) runs end to end: a row per
    variant and mode with every runner's time and the profiled triton call (no GPU kernels here)."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "RNNKIT_TRITON_CUDA_GRAPHS"}
    env.update(TRITON_INTERPRET="1", RNNKIT_TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src")] + [p for p in [env.get("PYTHONPATH")] if p]))
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_profile.py"), "--device", "cpu", "--tiny", "--warmup", "1",
               "--variants", "lstm", "lstm_peephole", "--modes", "training", "--repeats", "1", "--top", "2"]
    # in bfloat16, against a half dtype's GEMMs on its own operands: beside the float32 run
    out, half = _side_by_side([command, command[:command.index("--variants")] + [
        "--variants", "lstm", "--modes", "training", "--repeats", "1", "--dtype", "bfloat16",
        "--ab", "RNNKIT_TRITON_HALF_GEMM=half"]], env)
    host = [line.split() for line in out.stdout.splitlines() if line.startswith("    host ")]
    assert len(host) == 8 and all(float(line[1]) > 0 and line[2] == "us" for line in host), out.stdout  # 2 rows x 2 GEMMs
    rows = [line.split(" | ") for line in out.stdout.splitlines() if line.startswith("tiny | ")]
    assert [row[:3] for row in rows] == [["tiny", "lstm", "training"], ["tiny", "lstm_peephole", "training"]], out.stdout
    assert all(len(row) == 10 for row in rows), rows
    assert float(rows[0][4]) > 0 and rows[1][4].startswith("n/a"), rows  # native runs only the plain LSTM
    assert all(float(row[5]) > 0 and float(row[6]) > 0 and float(row[7]) > 0 for row in rows), rows
    assert "bfloat16; A/B: RNNKIT_TRITON_HALF_GEMM=half" in half.stdout, half.stdout
    rows = [line.split(" | ") for line in half.stdout.splitlines() if line.startswith("tiny | ")]
    assert len(rows) == 1 and len(rows[0]) == 10 and float(rows[0][7]) > 0, half.stdout


def test_the_one_call_gpu_session_plan_runs_dry(tmp_path):
    """benchmarks/gpu_call.sh, the next device session's one call, in its dry run: every stage is
    reached in order and the files that come back are written (the env stage runs for real)."""
    env = {**os.environ, "GPU_SESSION_DRY_RUN": "1", "GPU_CALL_TRAIN": "1", "OUT": str(tmp_path),
           "TMPDIR": str(tmp_path)}
    out = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_call.sh")], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    stages = [line.split()[0] for line in out.stdout.splitlines() if line.startswith("[")]
    assert stages == ["[env]", "[tests]", "[correct]", "[profile]", "[train]", "[bench-fp32"], out.stdout
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["logs.tar.gz", "summary.txt"]


def test_correctness_sweep_flags_a_wrong_or_nan_result():
    sweep = _sweep_module()
    expected = sweep.Result(["y", "dx"], [torch.ones(3, 2), torch.ones(4)])
    close = sweep.Result(expected.names, [torch.ones(3, 2) * (1 + 1e-7), torch.ones(4)])
    off = sweep.Result(expected.names, [torch.ones(3, 2) * (1 + 1e-3), torch.full((4,), float("nan"))])
    assert all(ratio <= 1 for ratio, _ in sweep._compare("call", close, expected, lambda name: 1e-5))
    ratios = [ratio for ratio, _ in sweep._compare("call", off, expected, lambda name: 1e-5)]
    assert ratios[0] > 1 and ratios[1] == float("inf")


def test_correctness_sweep_holds_a_float32_miss_to_the_float64_truth():
    """A float32 tensor over 1e-5 against the float32 reference passes where its error against the
    float64 ground truth is within twice the reference's own there, and fails otherwise or on NaN."""
    sweep = _sweep_module()
    truth = torch.ones(100, dtype=torch.float64)
    reference = (truth * (1 + 1e-5)).float()
    near, far = (truth * (1 - 1.5e-5)).float(), (truth * (1 - 3e-5)).float()
    assert sweep._against_truth("call", "dx", near, reference, truth, 1e-4)[0] <= 1
    assert sweep._against_truth("call", "dx", far, reference, truth, 1e-4)[0] > 1
    nan = torch.full((100,), float("nan"))
    assert sweep._against_truth("call", "dx", nan, reference, truth, 1e-4)[0] == float("inf")
    assert sweep._against_truth("call", "dx", near.view(1, 100), reference, truth, 1e-4)[0] == float("inf")  # shape
    # one badly conditioned element of the reference does not excuse a wrong block of triton's: the cap
    off = reference.clone()
    off[0] = 11.0  # the reference 100% off in RMS: 2x that would excuse anything
    wrong = truth.float().clone()
    wrong[50:60] = 0
    assert sweep._against_truth("call", "dx", wrong, off, truth, 1e-4)[0] > 1


def test_correctness_sweep_compares_kinked_cases_on_outputs_in_half_precision():
    """ReLU RNNs and cases with a cell or projection clip: their gradients jump, so in bfloat16 /
    float16 a cell within rounding of the kink lands on either side; every other case is compared
    on every gradient too."""
    sweep = _sweep_module()
    kinked = {case.id for case in sweep.CASES if sweep._kinked(case)}
    assert {"lstm-all-train", "lstm-cell_clip-eval", "lstm-proj_clip-eval", "rnn_relu-plain-eval",
            "lstm-stack_dropout-train"} <= kinked
    assert not kinked & {"lstm-plain-eval", "lstm-proj-eval", "gru-all-train", "lstm-layer_norm-eval",
                         "rnn_tanh-all-train"}


def test_correctness_sweep_cases_are_valid_modules():
    """Every case of the sweep builds (options the spec accepts) at both sizes it runs at."""
    sweep = _sweep_module()
    for case in sweep.CASES:
        for size in ("tiny", case.size):
            sweep._module(case, sweep.SIZES[size], torch.float32, "cpu")


# ---- the detector of a per-call copy --------------------------------------------------------

def _inside(event) -> set:
    """Names of the ops an op ran (its descendants in the profiler's tree)."""
    names = set()
    for child in event.cpu_children:
        names.add(child.name)
        names |= _inside(child)
    return names


def profile_op(call, op: str):
    """Run ``call`` under the profiler, warnings recorded -> (times ``op`` ran, the ops run inside
    it, the warnings' messages)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            call()
            if CUDA:
                torch.cuda.synchronize()
    events = [e for e in profile.events() if e.name == op]
    inside = set().union(*(_inside(e) for e in events)) if events else set()
    return len(events), inside, [str(w.message) for w in caught]


def test_detector_sees_a_copy_inside_an_op():
    count, inside, _ = profile_op(lambda: torch.randn(3, 4).t().contiguous(), "aten::contiguous")
    assert count == 1 and "aten::copy_" in inside
    count, inside, _ = profile_op(lambda: torch.randn(3, 4).contiguous().sum(), "aten::sum")
    assert count == 1 and not inside & COPY_OPS


# ---- CUDA: the native backend reads the packed buffer ---------------------------------------

NATIVE_CONFIGS = {  # plain configurations (the native backend's), I 24, H 32
    "lstm-2layers-bidirectional": ("lstm", dict(num_layers=2, bidirectional=True)),
    "lstm-proj": ("lstm", dict(num_layers=2, proj_size=16)),
    "lstm-bias_none": ("lstm", dict(bias=False)),
    "lstm-proj-bias_none": ("lstm", dict(num_layers=2, proj_size=16, bias=False)),
    "gru-2layers": ("gru", dict(num_layers=2)),
    "gru-bias_none-bidirectional": ("gru", dict(bias=False, bidirectional=True)),
    "rnn_tanh-bidirectional": ("rnn_tanh", dict(bidirectional=True)),
    "rnn_relu": ("rnn_relu", dict(nonlinearity="relu")),
}
MODULES = {"lstm": rnnkit.LSTM, "gru": rnnkit.GRU, "rnn_tanh": rnnkit.RNN, "rnn_relu": rnnkit.RNN}
TORCH_MODULES = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn_tanh": torch.nn.RNN, "rnn_relu": torch.nn.RNN}
I, H, T, B = 24, 32, 7, 5


def native_module(config: str, **kwargs):
    mode, options = NATIVE_CONFIGS[config]
    kwargs = {"device": "cuda", **kwargs}
    return MODULES[mode](I, H, **options, backend="native", **kwargs)


def call_native(module, x, training: bool, lengths=None):
    """One call of the module (forward, and backward in training); checks that cuDNN's op ran it."""
    module.train(training)
    if training:
        y, _ = module(x, lengths=lengths)
        y.square().sum().backward()
    else:
        with torch.no_grad():
            module(x, lengths=lengths)
    assert module.last_backend == "native"


def assert_reads_packed_buffer(module, call) -> None:
    """``call`` (twice) runs cuDNN on the module's packed buffer: ``aten::_cudnn_rnn`` ran, with no
    copy of the weights inside it and no warning that it made one, and the weights still alias
    the same buffer afterwards (no re-flatten)."""
    inner = getattr(module, "module", module)  # DistributedDataParallel holds the rnnkit module
    flat_ptr = inner.flat_weights.data_ptr()
    pointers = [p.data_ptr() for p in inner.parameters()]
    assert inner.flat_weights.storage_offset() == 0, "cuDNN reads the weight buffer from its storage's first byte"
    count, inside, warned = profile_op(lambda: (call(), call()), "aten::_cudnn_rnn")
    assert count >= 2, f"cuDNN's RNN op did not run ({count} calls of aten::_cudnn_rnn)"
    copies = sorted(inside & COPY_OPS)
    assert not copies, f"inside aten::_cudnn_rnn: {copies} (cuDNN copied the weights into a buffer of its own)"
    assert not [w for w in warned if COPY_WARNING in w], warned
    assert inner.flat_weights.data_ptr() == flat_ptr and [p.data_ptr() for p in inner.parameters()] == pointers


def _input(dtype=torch.float32):
    return torch.randn(T, B, I, device="cuda", dtype=dtype)


@needs_cuda
@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("config", list(NATIVE_CONFIGS))
def test_native_cudnn_reads_the_packed_buffer(config, training):
    module = native_module(config)
    x = _input()
    assert_reads_packed_buffer(module, lambda: call_native(module, x, training))


@needs_cuda
@pytest.mark.parametrize("config", list(NATIVE_CONFIGS))
def test_native_layout_is_cudnns(config):
    """rnnkit's offsets are those of torch.nn's buffer after .cuda() (laid out by cuDNN itself,
    through torch's flatten_parameters), and its buffer covers cuDNN's whole weight space."""
    mode, options = NATIVE_CONFIGS[config]
    reference = TORCH_MODULES[mode](I, H, **options).cuda()
    weights = reference._flat_weights
    storage = weights[0].untyped_storage()
    if any(w.untyped_storage().data_ptr() != storage.data_ptr() for w in weights):
        pytest.skip("torch.nn did not flatten its weights into one cuDNN buffer here")
    expected = [(w.data_ptr() - storage.data_ptr()) // w.element_size() for w in weights]
    module = native_module(config)
    base = module.flat_weights.untyped_storage().data_ptr()
    ours = [(getattr(module, n).data_ptr() - base) // module.flat_weights.element_size()
            for n in module._flat_weights_names]
    assert module._flat_weights_names == reference._flat_weights_names
    assert ours == expected, "rnnkit's offsets differ from cuDNN's weight layout"
    ours_bytes, cudnn_bytes = module.flat_weights.untyped_storage().nbytes(), storage.nbytes()
    assert ours_bytes >= cudnn_bytes, (
        f"rnnkit's buffer holds {ours_bytes} bytes, cuDNN's weight space {cudnn_bytes}: torch's try_get_weight_buf "
        "refuses a smaller storage, so cuDNN copies the weights at every call")


@needs_cuda
@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_native_after_to_cuda(training):
    module = native_module("lstm-2layers-bidirectional", device="cpu").to("cuda")
    x = _input()
    assert_reads_packed_buffer(module, lambda: call_native(module, x, training))


@needs_cuda
@pytest.mark.parametrize("assign", [False, True], ids=["copy", "assign-and-flatten"])
def test_native_after_load_state_dict(assign):
    """load_state_dict copies into the packed buffer; assign=True breaks the aliasing (rnnkit warns
    and cuDNN would copy), and flatten_parameters packs again."""
    mode, options = NATIVE_CONFIGS["lstm-2layers-bidirectional"]
    module = native_module("lstm-2layers-bidirectional")
    with warnings.catch_warnings():
        if assign:
            warnings.simplefilter("ignore")
        module.load_state_dict(TORCH_MODULES[mode](I, H, **options).cuda().state_dict(), assign=assign)
    if assign:
        module.flatten_parameters()
    x = _input()
    assert_reads_packed_buffer(module, lambda: call_native(module, x, True))


@needs_cuda
def test_native_copy_is_detected_when_the_aliasing_is_broken():
    """The control: with one weight moved out of the buffer, cuDNN copies (so the checks above can fail)."""
    module = native_module("lstm-2layers-bidirectional")
    module.weight_hh_l0.data = module.weight_hh_l0.data.clone()
    x = _input()
    count, inside, warned = profile_op(lambda: call_native(module, x, False), "aten::_cudnn_rnn")
    assert count >= 1 and inside & COPY_OPS, inside
    assert any(COPY_WARNING in w for w in warned), warned


@needs_cuda
@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_native_with_lengths(training):
    module = native_module("lstm-2layers-bidirectional")
    x = _input()
    lengths = torch.tensor([T, 1, 4, T, 2])
    assert_reads_packed_buffer(module, lambda: call_native(module, x, training, lengths))


@needs_cuda
def test_native_dropout_between_layers_in_training():
    """In training with dropout between layers, cuDNN runs the whole stack and draws the masks
    (on the CPU the native backend runs layer by layer on masks.py's): a layer run alone would
    not start at the buffer's first byte, where cuDNN reads a stack's weights in place."""
    module = native_module("lstm-2layers-bidirectional", dropout=0.3)
    x = _input()
    assert_reads_packed_buffer(module, lambda: call_native(module, x, True))


@needs_cuda
def test_native_float16():
    module = native_module("lstm-2layers-bidirectional", dtype=torch.float16)
    x = _input(torch.float16)
    assert_reads_packed_buffer(module, lambda: call_native(module, x, True))


@needs_cuda
@pytest.mark.parametrize("config", list(NATIVE_CONFIGS))
def test_native_gradients_are_views_of_one_packed_gradient(config):
    """cuDNN's backward writes the weights' gradient as one buffer placed as the weights are;
    autograd keeps each piece as the parameter's .grad, so flat_weights.grad is that buffer (no
    copy) and each .grad a view of it, as on the CPU (where rnnkit packs oneDNN's pieces)."""
    module = native_module(config)
    x = _input()
    call_native(module, x, True)
    grads = [p.grad for p in module.parameters()]
    flat_grad = module.flat_weights.grad
    assert all(g is not None and g.untyped_storage().data_ptr() == flat_grad.untyped_storage().data_ptr()
               for g in grads), "the parameters' .grad are not views of flat_weights.grad"
    for name, view in module.weight_views(flat_grad).items():
        assert view.data_ptr() == getattr(module, name).grad.data_ptr(), name


@pytest.fixture
def float32_throughout():
    """float32 GEMMs in cuBLAS and cuDNN without TF32, as the reference comparisons assume."""
    flags = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = flags


def assert_native_is_the_reference(module, x, hx=None) -> None:
    """Outputs and the gradients of x and every weight: native against the reference backend."""
    results = []
    for backend in ("native", "reference"):
        module.backend = backend
        y, _ = module(x, hx)
        grads = torch.autograd.grad(y.square().sum(), [x] + list(module.parameters()))
        assert module.last_backend == backend
        results.append((y, grads))
    (y, grads), (y_ref, grads_ref) = results
    assert_close(y, y_ref)
    for g, g_ref in zip(grads, grads_ref):
        assert_close(g, g_ref)
    module.backend = "native"


@needs_cuda
@pytest.mark.parametrize("config", ["lstm-bias_none", "lstm-2layers-bidirectional", "gru-2layers"])
def test_native_after_writes_to_the_whole_buffer_and_strided_states(config, float32_throughout):
    """cuDNN runs a stack without biases with both, reading them from room in its weight space
    that must stay zero: flat_weights leaves that room out, so whole-buffer writes (noise, an
    update from flat_weights.grad) never reach it, and native's numbers stay the reference's. States
    that are views (an expanded h0, a transposed batch-major c0) are taken as the general path takes
    them (cuDNN refuses a strided state)."""
    module = native_module(config)
    room = module._flat[module.layout.numel:]
    assert module.flat_weights.numel() == module.layout.numel and not room.any()
    x = _input().requires_grad_()
    call_native(module, x, True)
    with torch.no_grad():
        module.flat_weights.add_(0.1 * torch.randn_like(module.flat_weights))
        module.flat_weights.sub_(0.01 * module.flat_weights.grad)
    assert not room.any(), "a whole-buffer write reached cuDNN's bias room"
    D = module.spec.num_directions * module.spec.num_layers
    h0 = torch.randn(D, 1, module.spec.proj_sizes[0] or H, device="cuda").expand(-1, B, -1)
    c0 = torch.randn(B, D, H, device="cuda").transpose(0, 1)
    assert_native_is_the_reference(module, x, (h0, c0) if module.spec.mode == "lstm" else c0)


@needs_cuda
@pytest.mark.parametrize("config", ["lstm-2layers-bidirectional", "gru-2layers"])
def test_native_gradient_in_eval_mode(config, float32_throughout):
    """cuDNN keeps what its backward needs only in its training mode, which torch.nn enters by the
    train() flag (its RNNs in eval() fail on backward); rnnkit's enters it when a gradient is
    wanted: outputs and gradients against the reference backend, on the packed buffer, in eval()."""
    module = native_module(config).eval()
    x = _input().requires_grad_()
    assert_native_is_the_reference(module, x)
    assert_reads_packed_buffer(module, lambda: module(x)[0].sum().backward())


@needs_cuda
def test_native_under_distributed_data_parallel(tmp_path, monkeypatch):
    """DDP in one process (world size 1): gloo, else NCCL; skipped where neither starts."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # no network but the loopback on the GPU machine
        if name not in os.environ:
            monkeypatch.setenv(name, "lo")
    module = native_module("lstm-2layers-bidirectional")
    problems = []
    for backend in ("gloo", "nccl"):
        try:
            dist.init_process_group(backend, init_method=f"file://{tmp_path / backend}", rank=0, world_size=1)
        except Exception as error:
            problems.append(f"{backend}: {type(error).__name__}: {error}")
            continue
        try:
            wrapped = DistributedDataParallel(module, device_ids=[0])
        except Exception as error:
            dist.destroy_process_group()
            problems.append(f"{backend}: DistributedDataParallel: {type(error).__name__}: {error}")
            continue
        try:
            x = _input()

            def step():
                y, _ = wrapped(x)
                y.square().sum().backward()
                assert module.last_backend == "native"

            assert_reads_packed_buffer(wrapped, step)
            return
        finally:
            dist.destroy_process_group()
    pytest.skip("no one-process group could start: " + "; ".join(problems))


# ---- CUDA: the triton backend's compiled kernels --------------------------------------------

def _triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on")


@needs_cuda
@pytest.mark.skipif(_triton_interpreted(), reason="TRITON_INTERPRET=1 (tests/conftest.py's default) would interpret "
                                                  "the kernels; run with TRITON_INTERPRET=0 to test the compiled ones")
@pytest.mark.parametrize("graphs", ["1", "0"], ids=["cuda_graphs", "eager"])
def test_triton_plain_lstm_on_cuda(graphs, monkeypatch):
    """Forward and backward of a plain LSTM against the reference, three times (the first eager, the second
    captures the graph, the third replays it on new inputs and weights), then under no_grad."""
    pytest.importorskip("triton")
    monkeypatch.setenv("RNNKIT_TRITON_CUDA_GRAPHS", graphs)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    module = make_module("lstm", 24, 40, torch.float32, device="cuda", num_layers=2)
    lengths = [9, 3, 9, 1, 6]
    for call in range(3):
        if call:
            with torch.no_grad():
                module.flat_weights.add_(0.05 * torch.randn_like(module.flat_weights))
        x = torch.randn(9, 5, 24, device="cuda", requires_grad=True)
        hx = tuple(torch.randn(2, 5, 40, device="cuda", requires_grad=True) for _ in range(2))
        out_r, grad_r = run_backend(module, "reference", x, hx, lengths, training=True)
        out_t, grad_t = run_backend(module, "triton", x, hx, lengths, training=True)
        assert module.last_backend == "triton"
        for name, a, e in zip(["y", "h_n", "c_n"], out_t, out_r):
            assert_close(a, e, f"call {call + 1}: {name}")
        for name, a, e in zip(["dx", "dh0", "dc0", "d flat_weights"], grad_t, grad_r):
            assert_close(a, e, f"call {call + 1}: {name}")
    module.eval()
    with torch.no_grad():
        module.backend = "reference"
        expected = module(x, hx, lengths)
        module.backend = "triton"
        actual = module(x, hx, lengths)
    assert_close([actual[0], *actual[1]], [expected[0], *expected[1]], "no_grad")


@needs_cuda
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_lengths_inside_a_callers_cuda_graph(backend, monkeypatch):
    """A module call with lengths captured in the caller's own torch.cuda.graph (make_graphed_callables,
    torch.compile's reduce-overhead do the same): capture succeeds (no blocking host-to-device copy of a step
    mask) and a replay on new inputs gives the eager call's results."""
    if backend == "triton":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") == "1":
            pytest.skip("the interpreter runs on CPU tensors")
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    module = make_module("lstm", 24, 40, torch.float32, device="cuda", num_layers=2, layer_norm=True).eval()
    module.backend = backend
    lengths = torch.tensor([9, 3, 9, 1, 6])
    static_x = torch.randn(9, 5, 24, device="cuda")
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture (kernels compiled, caches filled)
            for _ in range(2):
                module(static_x, None, lengths)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y, (static_h, static_c) = module(static_x, None, lengths)
        x = torch.randn(9, 5, 24, device="cuda")
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        y, (h, c) = module(x, None, lengths)
    assert_close([static_y, static_h, static_c], [y, h, c], "replayed against eager")
