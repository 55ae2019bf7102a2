"""The native backend: torch's own RNN ops (oneDNN on CPU, cuDNN on GPU) for plain configurations.

What the vendor kernels compute is exactly the spec's plain cell, so for those configurations
rnnkit hands the module's parameters to ``torch._VF.lstm / gru / rnn_*`` as the weight list. The
parameters alias one contiguous buffer in cuDNN's order, so nothing is copied or re-packed per
call. Everything else (peepholes, layer norm, zoneout, variational dropout, ...) is not what these
kernels compute and goes to another backend: which options those are is read from the option
table (``rnnkit.spec.OPTIONS``, column ``native``).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from .masks import layer_dropout
from .passes import forward_ad_reason
from .spec import RNNSpec, options_in_use

_OPS = {"lstm": "lstm", "gru": "gru", "rnn_tanh": "rnn_tanh", "rnn_relu": "rnn_relu"}
_CELLS = {"lstm": "lstm_cell", "gru": "gru_cell", "rnn_tanh": "rnn_tanh_cell", "rnn_relu": "rnn_relu_cell"}
_LOW = {torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported, torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported}

_TORCH_SLOTS = ("W", "R", "b_W", "b_R", "W_hr")  # torch.nn's _flat_weights order within a pass


class NativeBackend:
    """torch.nn's own kernels (oneDNN / cuDNN) for the configurations they compute."""

    name = "native"

    def unavailable_reason(self) -> Optional[str]:
        return None

    def status(self) -> str:
        return "available"

    def unsupported_reason(self, spec: RNNSpec, device, dtype) -> Optional[str]:
        extras = options_in_use(spec, native=False)
        if extras:
            return f"torch's RNN kernels compute only the plain cell, not {', '.join(extras)}"
        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            return f"runs on cpu and cuda tensors, got device {device}"
        if not dtype.is_floating_point:
            return f"needs a floating-point dtype, got {dtype}"
        if torch.compiler.is_compiling():  # first: Dynamo cannot trace the oneDNN probe below
            if device.type == "cpu":
                return ("under torch.compile / torch.export on the CPU every cell family runs on the fused "
                        "backend's custom ops (torch's oneDNN LSTM op, mkldnn_rnn_layer, cannot be traced)")
        elif torch._C._functorch.peek_interpreter_stack() is not None:
            return ("torch.func transforms (vmap) have no rule for torch's RNN ops; the fused and triton backends' "
                    "custom ops have one")
        if device.type == "cpu" and dtype in _LOW and not _LOW[dtype]():
            return (f"{dtype} on this CPU: oneDNN has no {dtype} RNN kernel without the CPU's {dtype} instructions "
                    "(torch.nn's LSTM fails the same way); the fused backend computes it")
        if device.type == "cpu" and any(spec.proj_sizes):
            return "proj_size on the CPU: torch runs LSTMP without oneDNN (its slow path); the fused backend computes it"
        return forward_ad_reason()  # oneDNN's LSTM (mkldnn_rnn_layer) has no forward-mode AD formula

    def step(self, spec, w, x, h0, c0):
        """One step of a one-layer, one-direction cell, as torch.nn's cells compute it -> (h, c or None)."""
        op = getattr(torch._VF, _CELLS[spec.mode])
        if spec.mode == "lstm":
            return op(x, (h0, c0), w.W, w.R, w.b_W, w.b_R)
        return op(x, h0, w.W, w.R, w.b_W, w.b_R), None

    def run_stack(self, spec, weights, x, h0s, c0s, lengths, training):
        """Whole stack through torch._VF -> (y [T, B, F], h_ns, c_ns) as functional.run_stack.

        With dropout between layers in training, layer by layer: the dropout masks come from
        masks.py, as for every backend (torch's op would draw its own, on packed data with
        lengths), so a seed gives the same masks whichever backend runs."""
        if training and spec.dropout and spec.num_layers > 1:
            D, y, h_ns, c_ns = spec.num_directions, x, [], []
            for layer in range(spec.num_layers):
                part = slice(layer * D, (layer + 1) * D)
                y, h_n, c_n = self._run(spec, 1, weights[part], y, h0s[part], None if c0s is None else c0s[part],
                                        lengths)
                h_ns += h_n
                c_ns = None if c_n is None else c_ns + c_n
                if layer < spec.num_layers - 1:
                    y = layer_dropout(y, spec.dropout)
            return y, h_ns, c_ns
        return self._run(spec, spec.num_layers, weights, x, h0s, c0s, lengths)

    def _run(self, spec, num_layers, weights, x, h0s, c0s, lengths):
        """``num_layers`` layers (their ``weights``, ``h0s``, ``c0s``) through torch._VF, no dropout."""
        flat_weights = [getattr(w, slot) for w in weights for slot in _TORCH_SLOTS if getattr(w, slot) is not None]
        hx = torch.stack(h0s)
        state = (hx, torch.stack(c0s)) if spec.mode == "lstm" else hx
        op = getattr(torch._VF, _OPS[spec.mode])
        args = (flat_weights, spec.bias_mode == "double", num_layers, 0.0, False, spec.bidirectional)
        if lengths is None or x.shape[1] == 0:  # an empty batch has nothing to pack
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
