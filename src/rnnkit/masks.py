"""Masks of one forward call: the steps that run (`step_mask`, from the lengths) and the random ones,
variational dropout, DropConnect, zoneout, layer dropout.

Masks are drawn here, in one place and in a fixed order, from torch's default generator on
the input's device, and handed to the backends as tensors. Every backend therefore sees the
same masks under the same seed, which is what lets a fused kernel be tested against the
reference in training mode. One exception: on CUDA the native backend's dropout between layers
is cuDNN's own, drawn inside its one call (cuDNN reads a stack's weights in place only as a
whole stack), so there those masks are not these.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
from torch._C._functorch import TransformType

from .spec import CellSpec, RNNSpec

Zoneout = Union[torch.Tensor, float, None]


class PassMasks(NamedTuple):
    """What one layer-direction pass needs beyond its weights.

    recurrent: [B, Hr] variational mask on the h that enters R, already scaled by 1/(1-p).
    zoneout_h: [T, B, Hr] keep-old-value indicators d in training; the probability p in
        evaluation (the expectation, docs/spec.md); None when zoneout is off.
    zoneout_c: [T, B, H] or p or None, likewise for the LSTM cell state.
    """

    recurrent: Optional[torch.Tensor] = None
    zoneout_h: Zoneout = None
    zoneout_c: Zoneout = None


def in_transform(kind: TransformType) -> bool:
    """Whether a torch.func transform of this kind (vmap, jvp, ...) is active; False while Dynamo
    traces (it must not trace the calls below) and, in a fraction of a microsecond, outside any."""
    if torch.compiler.is_compiling() or torch._C._functorch.peek_interpreter_stack() is None:
        return False
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return any(i.key() == kind for i in retrieve_all_functorch_interpreters())


def stream_capturing(device: torch.device) -> bool:
    """Whether the current stream (of ``device``, the current device in a pass) is capturing a CUDA graph:
    a caller's (``torch.cuda.graph``, ``make_graphed_callables``, ``torch.compile(mode="reduce-overhead")``).
    False while torch.compile traces: Dynamo cannot trace the query (a torch function returning a bool),
    and a compiled graph's ops run without this Python."""
    if torch.compiler.is_compiling():
        return False
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def step_mask(lengths: Optional[torch.Tensor], T: int, device: torch.device,
              dtype: torch.dtype = torch.bool) -> Optional[torch.Tensor]:
    """[T, B] on ``device``: 1 (True) where t < length, else 0; None without lengths. The one builder of
    the steps that run, for every backend (the padding's zeroing, the passes' backward, Triton's loops).

    ``lengths`` is the checked [B] int64 on the CPU (`functional.check_lengths`). Inside a caller's
    CUDA-graph capture, where a blocking host-to-device copy is refused, the mask is filled on the
    device row by row (the lengths are host values: the caller's graph records them, as it records
    every shape); elsewhere the B lengths are copied over and compared there, not a T x B mask."""
    if lengths is None:
        return None
    if lengths.device.type == "cpu" and stream_capturing(device):
        mask = torch.ones(T, lengths.shape[0], dtype=dtype, device=device)
        for b, length in enumerate(lengths.tolist()):
            if length < T:
                mask[length:, b].fill_(0)
        return mask
    return (torch.arange(T, device=device).unsqueeze(1) < lengths.to(device).unsqueeze(0)).to(dtype)


def _bernoulli(shape, q: float, like: torch.Tensor) -> torch.Tensor:
    """1 with probability q, else 0. Under torch.func.vmap drawn out of place: with
    ``randomness="different"`` vmap refuses an in-place draw into a tensor it has not batched,
    and draws each member's own mask from this one."""
    if in_transform(TransformType.Vmap):
        return torch.bernoulli(torch.full(shape, q, dtype=like.dtype, device=like.device))
    return torch.empty(shape, dtype=like.dtype, device=like.device).bernoulli_(q)


def _dropout_mask(shape, p: float, like: torch.Tensor) -> torch.Tensor:
    """Keep with probability 1 − p, scaled by 1/(1 − p); all zeros for p = 1 (as torch's dropout)."""
    if p >= 1.0:
        return torch.zeros(shape, dtype=like.dtype, device=like.device)
    return _bernoulli(shape, 1.0 - p, like).div_(1.0 - p)


def _keep_old(shape, p: float, like: torch.Tensor) -> torch.Tensor:
    return _bernoulli(shape, p, like)


class PassDraw(NamedTuple):
    """The masks of one layer-direction pass, as drawn for one forward call."""

    input: Optional[torch.Tensor]  # [B, I] applied to x before the input projection
    dropconnect: Optional[torch.Tensor]  # [G·H, Hr] applied to R, scaled by 1/(1-p)
    masks: PassMasks


def draw_pass(spec: RNNSpec, cell: CellSpec, T: int, B: int, like: torch.Tensor, training: bool) -> PassDraw:
    """Draw the masks of one layer and direction (order: input, recurrent, DropConnect, zoneout h, c)."""
    p_h, p_c = cell.zoneout_h, cell.zoneout_c
    if not training:
        return PassDraw(None, None, PassMasks(None, p_h or None, p_c or None))
    hr, gh = cell.output_size, cell.gates * cell.hidden_size
    input_mask = _dropout_mask((B, cell.input_size), spec.input_dropout, like) if spec.input_dropout else None
    recurrent = _dropout_mask((B, hr), spec.recurrent_dropout, like) if spec.recurrent_dropout else None
    dropconnect = _dropout_mask((gh, hr), spec.dropconnect, like) if spec.dropconnect else None
    zoneout_h = _keep_old((T, B, hr), p_h, like) if p_h else None
    zoneout_c = _keep_old((T, B, cell.hidden_size), p_c, like) if p_c else None
    return PassDraw(input_mask, dropconnect, PassMasks(recurrent, zoneout_h, zoneout_c))


def layer_dropout(y: torch.Tensor, p: float) -> torch.Tensor:
    """Ordinary dropout on a layer's output sequence (cuDNN semantics, between layers)."""
    return y * _dropout_mask(y.shape, p, y)
