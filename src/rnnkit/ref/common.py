"""Pieces the reference cells share: projections, layer norm, zoneout and the time loop."""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from ..masks import Zoneout
from ..params import PassWeights

LN_EPS = 1e-5
LN_RANGE = 2.0**48  # rows beyond it are scaled into it first (see layer_norm)


def layer_norm(v: torch.Tensor, ln: Optional[Tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """LN over the last axis (biased variance, eps 1e-5); identity when ln is None.

    F.layer_norm squares deviations in the input's precision: float32 rows beyond ~1e19 give
    finite wrong values, then NaN. LN is scale-invariant (eps aside, which is far below float
    resolution for rows that large), so a row whose largest magnitude exceeds 2⁴⁸ is first scaled
    down to it: the answer stays finite and right wherever the pre-activations are finite (the
    fused kernels do the same, summing such rows in double). Rows within range are untouched; a
    row holding inf or NaN gives NaN.
    """
    if ln is None:
        return v
    largest = v.detach().abs().amax(-1, keepdim=True)
    scale = torch.where(largest > LN_RANGE, LN_RANGE / largest, 1.0)
    return F.layer_norm(v * scale, v.shape[-1:], ln[0], ln[1], eps=LN_EPS)


def linear(v: torch.Tensor, M: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
    out = v @ M.T
    return out if b is None else out + b


def input_projection(x: torch.Tensor, w: PassWeights) -> torch.Tensor:
    """LN_x(W x) + b_W for every step at once (the hoisted GEMM): [T, B, G·H]."""
    return _plus(layer_norm(x @ w.W.T, w.ln_x), w.b_W)


def recurrent_projection(h: torch.Tensor, w: PassWeights) -> torch.Tensor:
    """LN_h(R h) + b_R: [B, G·H]."""
    return _plus(layer_norm(h @ w.R.T, w.ln_h), w.b_R)


def _plus(v: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    return v if b is None else v + b


def zoneout_at(z: Zoneout, t: int) -> Zoneout:
    return z[t] if isinstance(z, torch.Tensor) else z


def zoned(z: Zoneout, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """d ∘ old + (1 − d) ∘ new (training: d ∈ {0, 1}; evaluation: d = p)."""
    return new if z is None else z * old + (1 - z) * new


def scan(step: Callable, T: int, state: tuple, step_mask: Optional[torch.Tensor], reverse: bool):
    """Run ``state = step(t, *state)`` over time; ``state[0]`` is the output h.

    With ``step_mask`` [T, B] (True where t < length), masked steps leave the state as it
    was and output zeros, so the reverse direction starts at each sequence's last step.
    Returns (y [T, B, Hr], final state).
    """
    ys = [None] * T
    for t in range(T - 1, -1, -1) if reverse else range(T):
        new = step(t, *state)
        if step_mask is not None:
            keep = step_mask[t].unsqueeze(1)
            new = tuple(torch.where(keep, n, s) for n, s in zip(new, state))
            ys[t] = torch.where(keep, new[0], torch.zeros((), dtype=new[0].dtype, device=new[0].device))
        else:
            ys[t] = new[0]
        state = new
    return torch.stack(ys), state
