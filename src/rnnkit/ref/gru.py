"""Reference GRU, both reset conventions (docs/spec.md, "Cells"): a plain loop over time."""
from __future__ import annotations

from typing import Optional

import torch

from ..masks import PassMasks
from ..params import PassWeights
from ..spec import CellSpec
from .common import input_projection, linear, recurrent_projection, scan, zoned, zoneout_at


def gru_pass(
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
    H = cell.hidden_size
    gx = input_projection(x, w)  # [T, B, 3H]

    def step(t, h):
        h_in = h if masks.recurrent is None else h * masks.recurrent
        x_r, x_z, x_n = gx[t].chunk(3, 1)
        if cell.reset_after:
            h_r, h_z, h_n = recurrent_projection(h_in, w).chunk(3, 1)  # LN_h(R h) + b_R
            r, z = torch.sigmoid(x_r + h_r), torch.sigmoid(x_z + h_z)
            n = torch.tanh(x_n + r * h_n)
        else:
            b_rz, b_n = (None, None) if w.b_R is None else (w.b_R[: 2 * H], w.b_R[2 * H :])
            h_r, h_z = linear(h_in, w.R[: 2 * H], b_rz).chunk(2, 1)
            r, z = torch.sigmoid(x_r + h_r), torch.sigmoid(x_z + h_z)
            n = torch.tanh(x_n + linear(r * h_in, w.R[2 * H :], b_n))
        h_new = (1 - z) * n + z * h
        return (zoned(zoneout_at(masks.zoneout_h, t), h, h_new),)

    y, (h_n,) = scan(step, x.shape[0], (h0,), step_mask, reverse)
    return y, h_n, None
