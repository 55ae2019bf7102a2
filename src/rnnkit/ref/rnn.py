"""Reference Elman RNN, tanh or relu (docs/spec.md, "Cells"): a plain loop over time."""
from __future__ import annotations

from typing import Optional

import torch

from ..masks import PassMasks
from ..params import PassWeights
from ..spec import CellSpec
from .common import input_projection, recurrent_projection, scan, zoned, zoneout_at


def rnn_pass(
    cell: CellSpec,
    x: torch.Tensor,  # [T, B, I]
    h0: torch.Tensor,  # [B, H]
    c0: None,
    w: PassWeights,
    step_mask: Optional[torch.Tensor],  # [T, B] bool
    reverse: bool,
    masks: PassMasks,
):
    """One layer in one direction -> (y [T, B, H], h_n [B, H], None)."""
    act = torch.tanh if cell.mode == "rnn_tanh" else torch.relu
    gx = input_projection(x, w)  # [T, B, H]

    def step(t, h):
        h_in = h if masks.recurrent is None else h * masks.recurrent
        h_new = act(gx[t] + recurrent_projection(h_in, w))
        return (zoned(zoneout_at(masks.zoneout_h, t), h, h_new),)

    y, (h_n,) = scan(step, x.shape[0], (h0,), step_mask, reverse)
    return y, h_n, None
