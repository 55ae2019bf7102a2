"""ONNX translations of rnnkit's pass ops, for ``torch.onnx.export`` of whole models.

A model that contains rnnkit layers exports like any other: ``torch.onnx.export(model, args)``.
Each layer-direction pass (the custom ops ``rnnkit::fused_pass_forward`` and
``rnnkit::triton_pass_forward``) becomes one standard ONNX ``LSTM`` / ``GRU`` / ``RNN`` node
(``direction="forward"`` or ``"reverse"``); layers chain, directions are joined by the model's own
``Concat`` / ``Add``, lengths become ``sequence_lens``. The weights are reordered to ONNX's gate
orders (docs/spec.md, "Gate orders elsewhere") by ``Split`` / ``Concat`` on the initializers, which
the exporter's optimizer folds into constants.

An int8 LSTM pass (``rnnkit::fused_int8_pass``, from `rnnkit.quantize`) becomes onnxruntime's
``com.microsoft.DynamicQuantizeLSTM`` on the same int8 weights and scales (stored uint8 with zero
point 128); int8 GRU and RNN have no such operator and are refused.

The translations are registered with onnxscript's torch library, the registry torch's exporter
reads (before it traces the model): right after that module is imported, through a post-import
hook that ``import rnnkit`` installs (`install`), so importing rnnkit does not import
onnxscript. Configurations ONNX's recurrent operators cannot express raise a ValueError naming
the option (`check_exportable`).
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

import torch

from ..spec import RNNSpec, not_carried_by

_REGISTRY_MODULE = "onnxscript.function_libs.torch_lib.registration"

# Why ONNX's LSTM / GRU / RNN operators cannot compute an option the option table says ONNX does
# not carry (the training-only options do not matter: a model is exported as it runs in evaluation).
NOT_IN_ONNX = {
    "proj_size": "ONNX's LSTM has no projection",
    "proj_clip": "ONNX's LSTM has no projection",
    "cell_clip": "ONNX's `clip` attribute clips the gates' inputs, not the cell state",
    "layer_norm": "ONNX's recurrent operators have no layer normalization",
    "zoneout": "ONNX's recurrent operators have no zoneout (its evaluation form mixes old and new states)",
}

_registered = False


def exporting() -> bool:
    """Whether torch.onnx.export is tracing the model (dynamo=True). Read from the exporter's flag
    itself: under its strict fallback (torch.export strict, when the non-strict capture failed)
    Dynamo folds ``torch.onnx.is_in_onnx_export()`` to False, and a refusal raised in the first
    capture would be skipped in the second."""
    try:
        from torch.onnx._internal.exporter import _flags
    except ImportError:  # a torch without the module: the public function only
        return torch.onnx.is_in_onnx_export()
    return bool(_flags._is_onnx_exporting) or torch.onnx.is_in_onnx_export()


def check_exportable(spec: RNNSpec) -> None:
    """Raise a ValueError naming the first option of ``spec`` that ONNX cannot express (the
    option table's ``onnx`` column, rnnkit.spec.OPTIONS)."""
    for option in not_carried_by("onnx", spec):
        raise refusal(option)


def refusal(option: str) -> ValueError:
    """The error for an option ONNX's recurrent operators cannot express."""
    why = NOT_IN_ONNX.get(option, "ONNX's recurrent operators cannot express it")
    return ValueError(f"torch.onnx.export: {option}: {why}; this layer cannot be exported to standard ONNX operators")


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs `register` right after onnxscript's torch-library registry module is imported."""

    def find_spec(self, name, path=None, target=None):
        if name != _REGISTRY_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        self.loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        sys.modules[_REGISTRY_MODULE] = module
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        register()


def install() -> None:
    """Register the translations now if onnxscript's registry is loaded, else right after it is."""
    if _REGISTRY_MODULE in sys.modules:
        register()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


def register() -> None:
    """Register the translations of the pass ops with onnxscript's torch library (once)."""
    global _registered
    if _registered:
        return
    try:
        from onnxscript.function_libs.torch_lib.registration import torch_op
    except ImportError as error:  # torch.onnx.export itself needs it
        raise ImportError("torch.onnx.export of rnnkit layers needs onnxscript (pip install onnxscript)") from error
    from . import _onnx_pass

    for backend in ("fused", "triton"):
        torch_op(f"rnnkit::{backend}_pass_forward", trace_only=True)(_onnx_pass.pass_forward)
    torch_op("rnnkit::fused_int8_pass", trace_only=True)(_onnx_pass.pass_forward_int8)
    _registered = True
