"""Who is measured: torch.nn, rnnkit's backends, onnxruntime — a registry of runners.

A runner builds a `Model` on the case's shared weights (the rnnkit reference
module's state_dict). Every model answers the same calls, so the protocol (measure.py)
checks and times them all alike:

    model.forward(x)       -> [y, *final states]  (flattened: h leaves, then c leaves)
    model.parameters()     -> the tensors training differentiates
    model.named_grads(gs)  -> {torch.nn name: gradient}, comparable across runners
"""
from __future__ import annotations

import importlib
import os
import re
import tempfile
from typing import Callable, Dict, List, Optional

import torch

import rnnkit

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
    """A registry entry: ``name`` (the --runners key), ``title`` (for tables), the modes it runs."""

    name: str
    title: str
    modes = MODES

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
        module = rnnkit_module(case.variant, case.shape, "reference", case.device, case.dtype)
        module.load_state_dict(case.reference(case.variant.name).state_dict())
        module.eval()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "model.onnx")
            try:
                export(module, path, include_lengths=bool(case.variant.lengths))
            except (ValueError, TypeError, NotImplementedError) as error:
                raise Unsupported(f"export: {error}") from None
            options = onnxruntime.SessionOptions()
            options.intra_op_num_threads = torch.get_num_threads()
            session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        return OnnxModel(case.variant.name, session)


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


RUNNERS: Dict[str, Callable[[], Runner]] = {
    "torch.nn": TorchNN,
    "onnxruntime": OnnxRuntime,
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
    raise ValueError(f"runners: unknown name {name!r}; expected one of {', '.join(available_names())}")
