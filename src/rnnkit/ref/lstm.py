"""Reference LSTM (docs/spec.md, "Cells" and "Options"): a plain loop over time, autograd through ops."""
from __future__ import annotations

from typing import Optional

import torch

from ..masks import PassMasks
from ..params import PassWeights
from ..spec import CellSpec
from .common import input_projection, layer_norm, recurrent_projection, scan, zoned, zoneout_at


def lstm_pass(
    cell: CellSpec,
    x: torch.Tensor,  # [T, B, I]
    h0: torch.Tensor,  # [B, Hr]
    c0: torch.Tensor,  # [B, H]
    w: PassWeights,
    step_mask: Optional[torch.Tensor],  # [T, B] bool, True where t < length
    reverse: bool,
    masks: PassMasks,
):
    """One layer in one direction -> (y [T, B, Hr], h_n [B, Hr], c_n [B, H])."""
    gx = input_projection(x, w)  # [T, B, G·H]
    p = w.peephole  # rows i, f, o (coupled: i, o)

    def step(t, h, c):
        h_in = h if masks.recurrent is None else h * masks.recurrent
        a = gx[t] + recurrent_projection(h_in, w)  # [B, G·H]
        if cell.coupled_gates:
            a_i, a_g, a_o = a.chunk(3, 1)
        else:
            a_i, a_f, a_g, a_o = a.chunk(4, 1)
        if p is not None:
            a_i = a_i + p[0] * c
            if not cell.coupled_gates:
                a_f = a_f + p[1] * c
        i = torch.sigmoid(a_i)
        f = 1 - i if cell.coupled_gates else torch.sigmoid(a_f)
        c_new = f * c + i * torch.tanh(a_g)
        if cell.cell_clip is not None:
            c_new = c_new.clamp(-cell.cell_clip, cell.cell_clip)
        if p is not None:
            a_o = a_o + p[-1] * c_new  # the output gate peeks at the new cell
        h_new = torch.sigmoid(a_o) * torch.tanh(layer_norm(c_new, w.ln_c))
        if w.W_hr is not None:
            h_new = h_new @ w.W_hr.T
            if cell.proj_clip is not None:
                h_new = h_new.clamp(-cell.proj_clip, cell.proj_clip)
        return zoned(zoneout_at(masks.zoneout_h, t), h, h_new), zoned(zoneout_at(masks.zoneout_c, t), c, c_new)

    y, (h_n, c_n) = scan(step, x.shape[0], (h0, c0), step_mask, reverse)
    return y, h_n, c_n
