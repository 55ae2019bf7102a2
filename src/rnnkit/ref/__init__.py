"""The reference backend: readable loops that are the executable form of docs/spec.md.

Every fused backend is tested against these. Each pass has the signature
``(cell, x, h0, c0, weights, step_mask, reverse, masks) -> (y, h_n, c_n)``; the backend's
``run_pass`` takes the lengths and derives the step mask.
"""
from ..masks import step_mask
from .gru import gru_pass
from .lstm import lstm_pass
from .rnn import rnn_pass

PASSES = {"lstm": lstm_pass, "gru": gru_pass, "rnn_tanh": rnn_pass, "rnn_relu": rnn_pass}


class ReferenceBackend:
    """Runs anywhere torch runs, in any floating dtype; differentiable through autograd."""

    name = "reference"

    def unavailable_reason(self):
        return None

    def status(self) -> str:
        return "available"

    def unsupported_reason(self, spec, device, dtype):
        return None

    def run_pass(self, cell, x, h0, c0, weights, lengths, reverse, masks):
        steps = step_mask(lengths, x.shape[0], x.device)  # [T, B]
        return PASSES[cell.mode](cell, x, h0, c0, weights, steps, reverse, masks)


__all__ = ["ReferenceBackend", "PASSES", "lstm_pass", "gru_pass", "rnn_pass"]
