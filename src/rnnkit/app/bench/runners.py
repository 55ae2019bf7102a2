"""Who is measured: torch.nn, rnnkit's backends, onnxruntime, int8 (rnnkit.quantize, torch.ao,
onnxruntime.quantization) and bfloat16 (rnnkit's and torch.nn's modules) — a registry of runners.

A runner builds a `Model` on the case's shared weights (the rnnkit reference
module's state_dict). Every model answers the same calls, so the protocol (measure.py)
checks and times them all alike:

    model.forward(x)       -> [y, *final states]  (flattened: h leaves, then c leaves)
    model.parameters()     -> the tensors training differentiates
    model.named_grads(gs)  -> {torch.nn name: gradient}, comparable across runners
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
import re
import tempfile
import warnings
from typing import Callable, Dict, List, Optional

import torch

import rnnkit
from rnnkit.testing import INT8_TOLERANCE as TESTING_INT8_TOLERANCE
from rnnkit.testing import TOLERANCE

from ..machine import cpu_flags
from .registry import VARIANTS, Variant

MODES = ("inference", "training")
RNNKIT_MODULES = {"lstm": rnnkit.LSTM, "gru": rnnkit.GRU, "rnn_tanh": rnnkit.RNN}
TORCH_MODULES = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn_tanh": torch.nn.RNN}
RNNKIT_CELLS = {"lstm": rnnkit.LSTMCell, "gru": rnnkit.GRUCell, "rnn_tanh": rnnkit.RNNCell}
TORCH_CELLS = {"lstm": torch.nn.LSTMCell, "gru": torch.nn.GRUCell, "rnn_tanh": torch.nn.RNNCell}


class Unsupported(Exception):
    """The runner cannot run this variant / mode; the message says why (not a failure)."""


def leaves(tree) -> List[torch.Tensor]:
    """Tensors of a nested tuple / list, depth first: (h, c) -> [h, c]; ([h0, h1], [c0, c1]) -> [h0, h1, c0, c1]."""
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in leaves(item)]
    return [tree]


def rnnkit_module(variant: Variant, shape, backend: str, device, dtype) -> torch.nn.Module:
    return RNNKIT_MODULES[variant.mode](**variant.module_kwargs(shape), backend=backend, device=device, dtype=dtype)


class Model:
    """One runner's network, with the weights of the case.

    ``timed_variant`` is the variant that actually runs: the case's, or for torch.nn the
    plain stand-in when torch.nn lacks the case's variant.
    """

    def __init__(self, timed_variant: str, modules: List[torch.nn.Module], info: Optional[dict] = None, feed: str = "lengths"):
        self.timed_variant = timed_variant
        self.modules = modules
        self.info = info or {}
        self.feed = feed  # how a variable-length batch goes in: "lengths" (lengths=) or "packed"

    def train(self, mode: bool) -> None:
        for m in self.modules:
            m.train(mode)

    def context(self):
        """What a timed call (forward and backward) runs inside: nothing, or a runner's setting."""
        return contextlib.nullcontext()

    def forward(self, x: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
        """[y, *final states]; with ``lengths``, y is padded with zeros past each sequence's end."""
        module = self.modules[0]
        if lengths is None:
            y, hy = module(x)
        elif self.feed == "packed":
            packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False)
            y, hy = module(packed)
            y, _ = torch.nn.utils.rnn.pad_packed_sequence(y, total_length=x.shape[0])
        else:
            y, hy = module(x, lengths=lengths)
        return [y] + leaves(hy)

    def parameters(self) -> List[torch.Tensor]:
        return [p for m in self.modules for p in m.parameters()]

    def named_grads(self, grads) -> Dict[str, torch.Tensor]:
        return {name: g for (name, _), g in zip(self.modules[0].named_parameters(), grads)}


class ChainModel(Model):
    """Per-layer sizes in torch.nn: one one-layer module per layer, output of one into the next."""

    def forward(self, x: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
        if lengths is not None:
            raise Unsupported("a chain of modules with variable lengths is not measured")
        hs, cs = [], []
        for m in self.modules:
            x, (h, c) = m(x)
            hs.append(h)
            cs.append(c)
        return [x] + hs + cs

    def named_grads(self, grads) -> Dict[str, torch.Tensor]:
        names = [
            re.sub(r"_l0\b", f"_l{k}", name) for k, m in enumerate(self.modules) for name, _ in m.named_parameters()
        ]
        return dict(zip(names, grads))


class StepModel(Model):
    """The step API in a generation loop: one call per time step, the state carried from call to call.

    ``api`` "cell": a one-step cell on x[t] (B, I); "module_step": the sequence module on
    x[t:t+1] (1, B, I). Either way forward returns what the sequence module returns over the
    whole input ([y, h_n, (c_n)]), so it is checked against the same reference.
    """

    def __init__(self, timed_variant: str, module: torch.nn.Module, api: str, info: Optional[dict] = None):
        super().__init__(timed_variant, [module], info)
        self.api = api

    def forward(self, x: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
        if lengths is not None:
            raise Unsupported("the step API runs one batch of equal lengths")
        step, state, ys = self.modules[0], None, []
        for t in range(x.shape[0]):
            if self.api == "cell":
                state = step(x[t], state)
                ys.append(state[0] if isinstance(state, tuple) else state)
            else:
                y, state = step(x[t : t + 1], state)
                ys.append(y[0])
        if self.api == "cell":  # a cell's (B, H) state as the module's (layers=1, B, H)
            state = tuple(s.unsqueeze(0) for s in state) if isinstance(state, tuple) else state.unsqueeze(0)
        return [torch.stack(ys)] + leaves(state)


def step_module(variant: Variant, shape, rnnkit_backend: Optional[str], device, dtype) -> torch.nn.Module:
    """The module a step-API variant calls once per step: rnnkit's (``rnnkit_backend`` given) or torch.nn's."""
    if shape.L != 1:
        raise Unsupported(f"the step API runs one layer; shape {shape.name} has L={shape.L}")
    if variant.api == "cell":
        table, kwargs = (RNNKIT_CELLS, {"backend": rnnkit_backend}) if rnnkit_backend else (TORCH_CELLS, {})
    else:
        table, kwargs = (RNNKIT_MODULES, {"backend": rnnkit_backend}) if rnnkit_backend else (TORCH_MODULES, {})
    return table[variant.mode](shape.I, shape.H, device=device, dtype=dtype, **kwargs)


def load_reference_weights(module: torch.nn.Module, case, variant: Variant) -> None:
    """The case's weights (the reference module's state_dict), with a cell's names (no ``_l0``)."""
    state = case.reference(variant.name).state_dict()
    if variant.api == "cell":
        state = {re.sub(r"_l0$", "", name): value for name, value in state.items()}
    module.load_state_dict(state)


class Runner:
    """A registry entry: ``name`` (the --runners key), ``title`` (for tables), the modes it runs;
    for a low-precision runner, the ``precision`` it computes in ("int8", "bfloat16") and the relative RMS error
    its check allows against the float reference (``tolerance``; None: the case dtype's,
    rnnkit.testing.TOLERANCE)."""

    name: str
    title: str
    modes = MODES
    precision: Optional[str] = None
    tolerance: Optional[float] = None

    def unavailable_reason(self) -> Optional[str]:
        return None

    def build(self, case) -> Model:
        """A model on ``case``'s weights; raises `Unsupported` when it cannot run the case."""
        raise NotImplementedError


class TorchNN(Runner):
    """torch.nn.LSTM / GRU / RNN: oneDNN on CPU, cuDNN on GPU. The baseline every speedup refers to."""

    name = "torch.nn"
    title = "torch.nn"

    def build(self, case) -> Model:
        variant = case.variant if case.variant.torch_nn else VARIANTS[case.variant.plain]
        if variant.api != "sequence":
            module = step_module(variant, case.shape, None, case.device, case.dtype)
            load_reference_weights(module, case, variant)
            return StepModel(variant.name, module, variant.api)
        reference = case.reference(variant.name)
        state = reference.state_dict()
        kwargs = variant.module_kwargs(case.shape)
        info = {} if variant is case.variant else {"stand_in": f"torch.nn lacks {case.variant.name}; timed plain {variant.name}"}
        if isinstance(kwargs["hidden_size"], list):
            spec = reference.spec
            modules = []
            for k in range(spec.num_layers):
                m = TORCH_MODULES[variant.mode](spec.layer_input_size(k), spec.hidden_sizes[k], device=case.device, dtype=case.dtype)
                m.load_state_dict({re.sub(rf"_l{k}\b", "_l0", n): v for n, v in state.items() if re.search(rf"_l{k}\b", n)})
                modules.append(m)
            return ChainModel(variant.name, modules, info)
        module = TORCH_MODULES[variant.mode](**kwargs, device=case.device, dtype=case.dtype)
        module.load_state_dict(state)
        return Model(variant.name, [module], info, feed="packed")


class RnnkitBackend(Runner):
    """An rnnkit backend by name; "reference" is the plain PyTorch loop over cell ops with autograd."""

    def __init__(self, backend: str):
        self.name = backend
        self.title = "autograd loop (rnnkit reference)" if backend == "reference" else f"rnnkit {backend}"

    def unavailable_reason(self) -> Optional[str]:
        if self.name == "auto":
            return None
        report = rnnkit.backends().get(self.name)
        return "not registered" if report is None else report["reason"]

    def build(self, case) -> Model:
        """The model on this backend; a backend that cannot run the configuration raises
        rnnkit.BackendUnavailableError at the first call (the check), reported as unsupported."""
        variant = case.variant
        if variant.api != "sequence":
            module = step_module(variant, case.shape, self.name, case.device, case.dtype)
            load_reference_weights(module, case, variant)
            return StepModel(variant.name, module, variant.api, {"backend": self.name})
        module = rnnkit_module(variant, case.shape, self.name, case.device, case.dtype)
        module.load_state_dict(case.reference(variant.name).state_dict())
        return Model(variant.name, [module], {"backend": self.name}, feed=variant.lengths or "lengths")


class FusedMKL(Runner):
    """The fused backend with its float32 GEMMs on MKL (`rnnkit.fused.use_fp32_gemm("mkl")`), beside
    "fused" on the CPU's choice: the measurement behind that choice, in the same process."""

    name = "fused-mkl"
    title = "rnnkit fused, MKL GEMMs"

    def unavailable_reason(self) -> Optional[str]:
        return RnnkitBackend("fused").unavailable_reason()

    def build(self, case) -> Model:
        if case.dtype != torch.float32:
            raise Unsupported(f"the float32 GEMM choice; the case is {str(case.dtype).replace('torch.', '')}")
        from rnnkit import fused

        model = RnnkitBackend("fused").build(case)
        model.context = lambda: fused.use_fp32_gemm("mkl")
        model.info["fp32_gemm"] = "mkl"
        return model


class OnnxRuntime(Runner):
    """The case exported with rnnkit.interop.onnx.export and run by onnxruntime (inference only, CPU)."""

    name = "onnxruntime"
    title = "onnxruntime"
    modes = ("inference",)

    def unavailable_reason(self) -> Optional[str]:
        try:
            importlib.import_module("onnxruntime")
            getattr(importlib.import_module("rnnkit.interop.onnx"), "export")
        except (ImportError, AttributeError) as error:
            return f"{type(error).__name__}: {error}"
        return None

    def build(self, case) -> Model:
        import onnxruntime
        from rnnkit.interop.onnx import export

        if case.variant.api != "sequence":
            raise Unsupported("times whole sequences only (no step API)")
        if str(case.device) != "cpu":
            raise Unsupported("runs on CPU only")
        if case.dtype not in (torch.float32, torch.float16):  # its CPU LSTM ("does not support double yet")
            raise Unsupported(f"its CPU recurrent kernels take float32 and float16, not {case.dtype}")
        module = rnnkit_module(case.variant, case.shape, "reference", case.device, case.dtype)
        module.load_state_dict(case.reference(case.variant.name).state_dict())
        module.eval()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "model.onnx")
            try:
                export(module, path, include_lengths=bool(case.variant.lengths))
            except (ValueError, TypeError, NotImplementedError) as error:
                raise Unsupported(f"export: {error}") from None
            path = self.prepare(path)
            options = onnxruntime.SessionOptions()
            options.intra_op_num_threads = torch.get_num_threads()
            session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        return OnnxModel(case.variant.name, session)

    def prepare(self, path: str) -> str:
        """The model file the session runs, made from the exported one at ``path``: that one."""
        return path


class OnnxModel(Model):
    def __init__(self, timed_variant: str, session):
        super().__init__(timed_variant, [])
        self.session = session
        self.input_name = session.get_inputs()[0].name

    def forward(self, x: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
        # the exported outputs are the module's: output, then h_n (per layer), then c_n
        feeds = {self.input_name: x.numpy()}
        if lengths is not None:  # ONNX sequence_lens: Y zero past each length, states at its last step
            feeds["lengths"] = lengths.numpy()
        return [torch.from_numpy(o) for o in self.session.run(None, feeds)]


# ---- int8: dynamic quantization, inference only (BENCH.md "Also measured: Low precision") ----------

# The check of an int8 runner: relative RMS error against the float64 reference on the case's
# float32 weights and input (outputs and final states), the float runners' check with int8's bound
# instead of float32's 1e-5 (rnnkit.testing.INT8_TOLERANCE, which gives the measurements behind it).
INT8_TOLERANCE = TESTING_INT8_TOLERANCE["float"]


def _cpu_float32(case, who: str) -> None:
    if str(case.device) != "cpu" or case.dtype != torch.float32:
        raise Unsupported(f"{who} runs float32 on the CPU; the case is {str(case.dtype).replace('torch.', '')} on {case.device}")


class Int8Runner(Runner):
    """An int8 runner: inference only, checked against the float reference within `INT8_TOLERANCE`."""

    modes = ("inference",)
    precision = "int8"
    tolerance = INT8_TOLERANCE


class RnnkitInt8(Int8Runner):
    """rnnkit's module for the case (backend "auto", the case's weights) through `rnnkit.quantize`:
    int8 weights per row, int8 activations per row (dynamic), the fused int8 passes; sequence and
    step API (cells, T=1 calls), lengths= and PackedSequence feeds as the float runners."""

    name = "int8"
    title = "rnnkit int8 (rnnkit.quantize)"

    def unavailable_reason(self) -> Optional[str]:
        report = rnnkit.backends().get("fused")
        if report is None or not report["available"]:
            return "the int8 kernels are the fused backend's: " + ("not registered" if report is None else report["reason"])
        return None

    def build(self, case) -> Model:
        _cpu_float32(case, "rnnkit.quantize")
        model = RnnkitBackend("auto").build(case)
        model.modules = [rnnkit.quantize(m) for m in model.modules]
        model.info = {"weights": "int8", "int8_kernel": rnnkit.quantized.int8_kernel()}
        return model


class TorchAOInt8(Int8Runner):
    """torch.nn's model for the case (as the torch.nn runner builds it) through
    ``torch.ao.quantization.quantize_dynamic(..., dtype=torch.qint8)``: torch.ao.nn.quantized.dynamic
    LSTM / GRU / LSTMCell / GRUCell (fbgemm). Only what torch.nn itself runs and torch.ao quantizes:
    no stand-ins for variants torch.nn lacks, no RNN (it stays float32), no proj_size.

    Note: torch.ao.quantization is deprecated (torch 2.13 warns at every quantize_dynamic that it
    "will be removed in 2.10", and that quantized tensor creation is deprecated; the way forward is
    torchao's quantize_). The warnings are silenced around that call only: the runner times what
    users of torch.nn run today, while it exists.
    """

    name = "torch.ao-int8"
    title = "torch.ao dynamic int8"
    QUANTIZED = (torch.nn.LSTM, torch.nn.GRU, torch.nn.LSTMCell, torch.nn.GRUCell)
    DEPRECATIONS = ("torch.ao.quantization is deprecated", r"torch.quantize_per_tensor, .* are deprecated")

    def unavailable_reason(self) -> Optional[str]:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                getattr(importlib.import_module("torch.ao.quantization"), "quantize_dynamic")
                importlib.import_module("torch.ao.nn.quantized.dynamic")
        except (ImportError, AttributeError) as error:
            return f"{type(error).__name__}: {error}"
        engines = torch.backends.quantized.supported_engines
        if "fbgemm" not in engines and "x86" not in engines:
            return f"no x86 / fbgemm quantized engine in this torch (engines: {', '.join(engines)})"
        return None

    def build(self, case) -> Model:
        from torch.ao.quantization import quantize_dynamic

        _cpu_float32(case, "torch.ao dynamic quantization")
        if not case.variant.torch_nn:
            raise Unsupported(f"torch.nn lacks {case.variant.name}, so torch.ao has no quantized counterpart")
        model = TorchNN().build(case)
        quantized = []
        for module in model.modules:
            if getattr(module, "proj_size", 0):
                raise Unsupported("torch.ao's dynamic LSTM does not run proj_size (its packed weights expect K = hidden_size)")
            with warnings.catch_warnings():
                for deprecated in self.DEPRECATIONS:
                    warnings.filterwarnings("ignore", message=deprecated)
                # quantize_dynamic swaps a model's children, never the model itself: hand it a holder
                q = quantize_dynamic(torch.nn.Sequential(module), set(self.QUANTIZED), dtype=torch.qint8)[0]
            if type(q) is type(module):
                raise Unsupported(f"torch.ao.quantization.quantize_dynamic leaves torch.nn.{type(module).__name__} in float32")
            quantized.append(q)
        model.modules = quantized
        model.info = {"weights": "int8"}
        return model


# ONNX ops of onnxruntime's dynamic quantization; LSTM / GRU / RNN left among the ops means float32 recurrences
ONNX_INT8_OPS = frozenset({"DynamicQuantizeLSTM", "DynamicQuantizeMatMul", "MatMulInteger", "DynamicQuantizeLinear"})
ONNX_RECURRENT_OPS = frozenset({"LSTM", "GRU", "RNN"})


def onnx_op_types(graph) -> set:
    """Op types of an ONNX graph and its subgraphs (Loop / Scan / If bodies)."""
    import onnx

    found = set()
    for node in graph.node:
        found.add(node.op_type)
        for attribute in node.attribute:
            for subgraph in ([attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else []) + list(attribute.graphs):
                found |= onnx_op_types(subgraph)
    return found


class _Unless(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


class OnnxRuntimeInt8(OnnxRuntime, Int8Runner):
    """The case exported as the onnxruntime runner does, then
    ``onnxruntime.quantization.quantize_dynamic(weight_type=QuantType.QInt8)``: LSTM nodes become
    DynamicQuantizeLSTM (int8 weights per tensor, activations uint8 per tensor, dynamic).
    onnxruntime quantizes no GRU / RNN node: those cases are unsupported rather than timed in
    float32 under an int8 name.

    On a CPU without VNNI (AVX2 only) the weights are quantized to 7 bits (``reduce_range=True``,
    as onnxruntime's documentation advises there): its u8 x s8 kernels add pairs of products in
    int16 (vpmaddubsw), which saturates with full-range weights. Measured on the AMD EPYC (AVX2),
    the CPU grid's LSTMs: relative RMS error against float64 10-16% with full range (twice
    `INT8_TOLERANCE` and more), 1.3-1.7% with reduce_range.
    """

    name = "onnxruntime-int8"
    title = "onnxruntime dynamic int8"

    @staticmethod
    def reduce_range() -> bool:
        flags = cpu_flags()
        return flags is None or not {"avx512_vnni", "avx_vnni"} & set(flags)

    def unavailable_reason(self) -> Optional[str]:
        reason = super().unavailable_reason()
        if reason is not None:
            return reason
        try:
            getattr(importlib.import_module("onnxruntime.quantization"), "quantize_dynamic")
        except (ImportError, AttributeError) as error:
            return f"{type(error).__name__}: {error}"
        return None

    def build(self, case) -> Model:
        _cpu_float32(case, "onnxruntime.quantization")
        model = super().build(case)
        model.info = {"weights": "int8", "reduce_range": self.reduce_range()}
        return model

    def prepare(self, path: str) -> str:
        import onnx
        from onnxruntime.quantization import QuantType, quantize_dynamic

        out = path.replace(".onnx", ".int8.onnx")
        advice = _Unless("pre-processing")  # "consider pre-processing": symbolic shape inference, nothing for an LSTM
        logging.getLogger().addFilter(advice)
        try:
            quantize_dynamic(path, out, weight_type=QuantType.QInt8, reduce_range=self.reduce_range())
        finally:
            logging.getLogger().removeFilter(advice)
        ops = onnx_op_types(onnx.load(out).graph)
        left = sorted(ops & ONNX_RECURRENT_OPS)
        if left:
            raise Unsupported(f"onnxruntime.quantization.quantize_dynamic leaves {', '.join(left)} in float32 "
                              "(it quantizes LSTM nodes only)")
        if not ops & ONNX_INT8_OPS:
            raise Unsupported(f"onnxruntime.quantization.quantize_dynamic made no int8 op (ops: {', '.join(sorted(ops))})")
        return out


# ---- bfloat16: the module in bfloat16, fed and read in float32 (BENCH.md "Also measured: Low precision") --


class LowPrecisionModel(Model):
    """A runner's model with its parameters in ``dtype``: the case's float32 input cast to it per
    call and the results read back in float32 (the casts are part of the timed call, as they are
    of a float32 pipeline calling a bfloat16 layer)."""

    def __init__(self, model: Model, dtype: torch.dtype):
        super().__init__(model.timed_variant, model.modules, dict(model.info), model.feed)
        self.inner, self.dtype = model, dtype
        for m in self.modules:
            m.to(dtype)
        self.info["weights"] = str(dtype).replace("torch.", "")

    def forward(self, x: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
        return [o.float() for o in self.inner.forward(x.to(self.dtype), lengths)]

    def named_grads(self, grads) -> Dict[str, torch.Tensor]:
        return self.inner.named_grads(grads)


class Bf16Runner(Runner):
    """A bfloat16 runner: checked against the float64 reference within bfloat16's tolerance (or twice
    the error of the reference on bfloat16-rounded weights, input and products, `Case.rounded_reference_errors`)."""

    precision = "bfloat16"
    tolerance = TOLERANCE[torch.bfloat16]

    def _build(self, case) -> Model:
        raise NotImplementedError

    def build(self, case) -> Model:
        if case.dtype != torch.float32:
            raise Unsupported(f"{self.name} casts a float32 case's weights to bfloat16; the case is "
                              f"{str(case.dtype).replace('torch.', '')}")
        return LowPrecisionModel(self._build(case), torch.bfloat16)


class RnnkitBf16(Bf16Runner):
    """rnnkit's module for the case (backend "auto") in bfloat16 (``.to(torch.bfloat16)``): the fused
    kernels read its matrices in bfloat16 (vdpbf16ps where the CPU has AVX512_BF16, else widened once
    per pass) and compute in float32."""

    name = "bf16"
    title = "rnnkit bfloat16"

    def _build(self, case) -> Model:
        return RnnkitBackend("auto").build(case)


class TorchNNBf16(Bf16Runner):
    """torch.nn's model for the case (as the torch.nn runner builds it) in bfloat16: oneDNN's bf16
    kernels where the CPU has them, torch's generic CPU path otherwise."""

    name = "torch.nn-bf16"
    title = "torch.nn bfloat16"

    def _build(self, case) -> Model:
        return TorchNN().build(case)


RUNNERS: Dict[str, Callable[[], Runner]] = {
    "torch.nn": TorchNN,
    "fused-mkl": FusedMKL,
    "onnxruntime": OnnxRuntime,
    "int8": RnnkitInt8,
    "torch.ao-int8": TorchAOInt8,
    "onnxruntime-int8": OnnxRuntimeInt8,
    "bf16": RnnkitBf16,
    "torch.nn-bf16": TorchNNBf16,
}


def register(name: str, factory: Callable[[], Runner]) -> None:
    """Add a runner (tests inject a wrong one to see the check catch it)."""
    RUNNERS[name] = factory


def unregister(name: str) -> None:
    RUNNERS.pop(name, None)


def available_names() -> List[str]:
    """Every runner: torch.nn, each registered rnnkit backend (discovered now), auto, then the extras."""
    backends = list(rnnkit.backends())
    ordered = ["torch.nn"] + [b for b in backends if b != "reference"] + ["reference", "auto"]
    return ordered + [n for n in RUNNERS if n not in ordered]


DEFAULT_EXCLUDED = ("auto",)  # it times one of the others again


def make(name: str) -> Runner:
    if name in RUNNERS:
        return RUNNERS[name]()
    if name == "auto" or name in rnnkit.backends():
        return RnnkitBackend(name)
    raise ValueError(f"--runners: unknown name {name!r}; expected one of {', '.join(available_names())}")
