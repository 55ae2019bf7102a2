"""The ONNX translation of a pass op (registered by onnx_ops.register; imports onnxscript)."""
from typing import Optional

from onnxscript.function_libs.torch_lib.tensor_typing import TFloat, TTensor
from onnxscript.onnx_opset import opset18 as op

from .onnx_ops import refusal

_ONNX_GATES = {"lstm": "iofg", "gru": "zrn", "rnn_tanh": "h", "rnn_relu": "h"}


def _gate_blocks(t, src: str, dst: str):
    """``t``'s gate blocks (equal parts of axis 0) reordered from ``src`` to ``dst``;
    a gate ``src`` lacks (the forget gate of coupled gates) is zeros."""
    size = t.shape[0] // len(src)  # static: the weights are initializers
    blocks = [op.Slice(t, [k * size], [(k + 1) * size], axes=[0]) for k in range(len(src))]
    zeros = None
    out = []
    for gate in dst:
        if gate in src:
            out.append(blocks[src.index(gate)])
        else:
            if zeros is None:
                zeros = op.Sub(blocks[0], blocks[0])
            out.append(zeros)
    return out[0] if len(out) == 1 else op.Concat(*out, axis=0)


def pass_forward(
    x: TFloat, h0: TFloat, c0: Optional[TFloat], W: TFloat, R: TFloat, b_W: Optional[TFloat], b_R: Optional[TFloat],
    W_hr: Optional[TFloat], peephole: Optional[TFloat], ln_x_gain: Optional[TFloat], ln_x_shift: Optional[TFloat],
    ln_h_gain: Optional[TFloat], ln_h_shift: Optional[TFloat], ln_c_gain: Optional[TFloat],
    ln_c_shift: Optional[TFloat], lengths: Optional[TTensor], recurrent_mask: Optional[TFloat],
    zoneout_h_mask: Optional[TFloat], zoneout_c_mask: Optional[TFloat], mode: str, zoneout_h: float,
    zoneout_c: float, cell_clip: Optional[float], proj_clip: Optional[float], coupled_gates: bool,
    reset_after: bool, reverse: bool, training: bool,
):
    """One pass (rnnkit/passes.py's schema) as one ONNX recurrent node; the options ONNX cannot
    express (the option table's onnx column) are refused by name, as `check_exportable` does."""
    in_use = {
        "proj_size": W_hr is not None, "proj_clip": proj_clip is not None, "cell_clip": cell_clip is not None,
        "layer_norm": ln_h_gain is not None or ln_x_gain is not None,
        "zoneout": bool(zoneout_h or zoneout_c) or zoneout_h_mask is not None or zoneout_c_mask is not None,
    }
    for option, used in in_use.items():
        if used:
            raise refusal(option)
    if training or recurrent_mask is not None:
        raise ValueError("torch.onnx.export: the model must be exported in evaluation mode (model.eval())")
    src = "igo" if (mode == "lstm" and coupled_gates) else {"lstm": "ifgo", "gru": "rzn"}.get(mode, "h")
    dst = _ONNX_GATES[mode]
    hidden = R.shape[1]
    direction = "reverse" if reverse else "forward"
    unsqueeze = lambda t: op.Unsqueeze(t, [0])  # noqa: E731
    W_onnx = unsqueeze(_gate_blocks(W, src, dst))
    R_onnx = unsqueeze(_gate_blocks(R, src, dst))
    B_onnx = None
    if b_W is not None or b_R is not None:
        b_in = _gate_blocks(b_W, src, dst) if b_W is not None else None
        b_rec = _gate_blocks(b_R, src, dst) if b_R is not None else None
        b_in = b_in if b_in is not None else op.Sub(b_rec, b_rec)
        b_rec = b_rec if b_rec is not None else op.Sub(b_in, b_in)
        B_onnx = unsqueeze(op.Concat(b_in, b_rec, axis=0))
    sequence_lens = op.Cast(lengths, to=6) if lengths is not None else None  # INT32
    initial_h = unsqueeze(h0)
    if mode == "lstm":
        P_onnx = None
        if peephole is not None:  # rows i, f, o (coupled: i, o) -> ONNX's i, o, f
            P_onnx = unsqueeze(op.Reshape(_gate_blocks(peephole, "io" if coupled_gates else "ifo", "iof"),
                                          [-1]))
        Y, Y_h, Y_c = op.LSTM(x, W_onnx, R_onnx, B_onnx, sequence_lens, initial_h, unsqueeze(c0), P_onnx,
                              hidden_size=hidden, direction=direction, input_forget=int(coupled_gates))
        c_n = op.Squeeze(Y_c, [0])
    else:
        if mode == "gru":
            Y, Y_h = op.GRU(x, W_onnx, R_onnx, B_onnx, sequence_lens, initial_h, hidden_size=hidden,
                            direction=direction, linear_before_reset=int(reset_after))
        else:
            Y, Y_h = op.RNN(x, W_onnx, R_onnx, B_onnx, sequence_lens, initial_h, hidden_size=hidden,
                            direction=direction, activations=["Relu" if mode == "rnn_relu" else "Tanh"])
        c_n = op.Squeeze(op.Slice(Y_h, [0], [0], axes=[2]), [0])  # an empty tensor: GRU/RNN have no cell state
    return op.Squeeze(Y, [1]), op.Squeeze(Y_h, [0]), c_n, op.SequenceEmpty()  # saved: nothing in evaluation
