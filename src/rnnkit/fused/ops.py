"""The fused CPU kernels as the custom ops ``rnnkit::fused_pass_forward`` / ``fused_pass_backward``
(schema: rnnkit/passes.py): the C++ entry points of csrc/ops.cpp take every argument by name."""
from __future__ import annotations

from typing import List, Tuple

import torch

from ..passes import PassOps, output_shapes
from . import build


def _forward(*values):
    return build.extension().pass_forward(*values)


def _backward(*values):
    return build.extension().pass_backward(*values)


def _saved_shapes(args) -> List[Tuple[tuple, torch.dtype]]:
    """What csrc/pass.h's Saved slots hold in a training forward (kInputRaw ... kOutput), for the
    fake implementation; () shapes stand for the empty tensors of unused slots. A half-precision
    call (x in its bfloat16 / float16 matrices' dtype) keeps them in float32, its y too (kOutput)."""
    x, mode = args["x"], args["mode"]
    half = x.dtype in (torch.bfloat16, torch.float16) and args["W"].dtype == x.dtype
    dtype = torch.float32 if half else x.dtype
    T, B, H, Hr = output_shapes(args)
    GH = args["W"].shape[0]
    lstm, ln = mode == "lstm", args["ln_h_gain"] is not None
    ln_x = args["ln_x_gain"] is not None
    gate_width = {"lstm": GH, "gru": (4 * H if args["reset_after"] else 3 * H)}.get(mode, H)
    clipped = lstm and args["W_hr"] is not None and args["proj_clip"] is not None
    empty = ((0,), dtype)
    either = lambda on, shape, kind=dtype: (shape, kind) if on else empty  # noqa: E731
    return [
        either(ln_x, (T * B, GH)), either(ln_x, (T * B, 1)), either(ln_x, (T * B, 1)),
        ((T, B, gate_width), dtype),
        either(lstm, (T, B, H)),
        either(ln, (T, B, GH)), either(ln, (T, B)), either(ln, (T, B)),
        either(lstm and ln, (T, B)), either(lstm and ln, (T, B)),
        either(clipped, (T, B, Hr), torch.bool),
        either(half, (T, B, Hr)),
    ]


OPS = PassOps("fused", _forward, _backward, _saved_shapes, device_types=("cpu",))
