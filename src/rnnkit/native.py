"""The native backend: torch's own RNN ops (oneDNN on CPU, cuDNN on GPU) for plain configurations.

What the vendor kernels compute is exactly SPEC.md's plain cell, so for those
configurations rnnkit hands the packed buffer's views to ``torch._VF.lstm / gru / rnn_*``
as the weight list. The views are cut from one contiguous buffer in cuDNN's order, so
nothing is copied or re-packed per call. Everything else (peepholes, layer norm, zoneout,
variational dropout, ...) is not what these kernels compute and goes to another backend.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from .params import TORCH_PIECES
from .spec import RNNSpec

_OPS = {"lstm": "lstm", "gru": "gru", "rnn_tanh": "rnn_tanh", "rnn_relu": "rnn_relu"}


def _extras(spec: RNNSpec) -> list:
    """The options of ``spec`` that torch's RNN ops do not compute."""
    used = {
        "peephole": spec.peephole,
        "coupled_gates": spec.coupled_gates,
        "layer_norm": spec.layer_norm,
        "cell_clip": spec.cell_clip is not None,
        "proj_clip": spec.proj_clip is not None,
        "zoneout": any(spec.zoneout),
        "input_dropout": spec.input_dropout > 0,
        "recurrent_dropout": spec.recurrent_dropout > 0,
        "dropconnect": spec.dropconnect > 0,
        "reset_after=False": not spec.reset_after,
        "per-layer sizes": spec.per_layer,
        "merge='sum'": spec.bidirectional and spec.merge == "sum",
        f"bias_mode={spec.bias_mode!r}": spec.bias_mode not in ("double", "none"),
    }
    return [name for name, on in used.items() if on]


class NativeBackend:
    """torch.nn's own kernels (oneDNN / cuDNN) for the configurations they compute."""

    name = "native"

    def unavailable_reason(self) -> Optional[str]:
        return None

    def unsupported_reason(self, spec: RNNSpec, device, dtype) -> Optional[str]:
        extras = _extras(spec)
        if extras:
            return f"torch's RNN kernels compute only the plain cell, not {', '.join(extras)}"
        if torch.device(device).type not in ("cpu", "cuda"):
            return f"runs on cpu and cuda tensors, got device {device}"
        if not dtype.is_floating_point:
            return f"needs a floating-point dtype, got {dtype}"
        return None

    def run_stack(self, spec, layout, weights, x, h0s, c0s, lengths, training):
        """Whole stack through torch._VF -> (y [T, B, F], h_ns, c_ns) as functional.run_stack."""
        flat_weights = [
            layout.view(weights, e.name) for e in layout if e.piece in TORCH_PIECES
        ]  # torch.nn's _flat_weights order, the buffer's order
        hx = torch.stack(h0s)
        state = (hx, torch.stack(c0s)) if spec.mode == "lstm" else hx
        op = getattr(torch._VF, _OPS[spec.mode])
        args = (flat_weights, spec.bias_mode == "double", spec.num_layers, spec.dropout, training, spec.bidirectional)
        with warnings.catch_warnings():
            # torch says it runs LSTMP without oneDNN; true, and nothing the caller can act on
            warnings.filterwarnings("ignore", message="LSTM with projections is not supported with oneDNN")
            return self._run(op, spec, x, state, args, lengths)

    @staticmethod
    def _run(op, spec, x, state, args, lengths):
        if lengths is None:
            out = op(x, state, *args, False)
        else:
            packed = pack_padded_sequence(x, lengths, enforce_sorted=False)
            order, unorder = packed.sorted_indices, packed.unsorted_indices
            sorted_state = tuple(s.index_select(1, order) for s in state) if spec.mode == "lstm" else state.index_select(1, order)
            out = op(packed.data, packed.batch_sizes, sorted_state, *args)
            y, _ = pad_packed_sequence(PackedSequence(out[0], packed.batch_sizes, order, unorder), total_length=x.shape[0])
            out = (y,) + tuple(s.index_select(1, unorder) for s in out[1:])
        y, h_n = out[0], out[1]
        c_ns = list(out[2].unbind(0)) if spec.mode == "lstm" else None
        return y, list(h_n.unbind(0)), c_ns
