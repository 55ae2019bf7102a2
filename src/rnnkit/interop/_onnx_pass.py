"""The ONNX translation of a pass op (registered by onnx_ops.register; imports onnxscript)."""
from typing import Optional

from onnxscript.function_libs.torch_lib.tensor_typing import TFloat, TTensor
from onnxscript.onnx_opset import opset18 as op
import onnx
from onnx.defs import OpSchema
from onnxscript.values import Op, Opset


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


def _check(W_hr, proj_clip, cell_clip, ln_x_gain, ln_h_gain, zoneout_h, zoneout_c, zoneout_h_mask, zoneout_c_mask,
           recurrent_mask, training) -> None:
    """Refuse, by name, the options ONNX cannot express (the option table's onnx column, as
    `check_exportable` does), and a pass in training mode."""
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


def _gates(mode: str, coupled_gates: bool):
    """(rnnkit's gate order of the pass's weights, ONNX's)."""
    src = "igo" if (mode == "lstm" and coupled_gates) else {"lstm": "ifgo", "gru": "rzn"}.get(mode, "h")
    return src, _ONNX_GATES[mode]


def _unsqueeze(t):
    return op.Unsqueeze(t, [0])


def _bias(b_W, b_R, src: str, dst: str):
    """ONNX's B [1, 2·G·H] (input bias, then recurrent), zeros for a missing half; None without either."""
    if b_W is None and b_R is None:
        return None
    b_in = _gate_blocks(b_W, src, dst) if b_W is not None else None
    b_rec = _gate_blocks(b_R, src, dst) if b_R is not None else None
    b_in = b_in if b_in is not None else op.Sub(b_rec, b_rec)
    b_rec = b_rec if b_rec is not None else op.Sub(b_in, b_in)
    return _unsqueeze(op.Concat(b_in, b_rec, axis=0))


def _peephole(peephole, coupled_gates: bool):
    """ONNX's P [1, 3H] (rows i, f, o, or coupled i, o -> ONNX's i, o, f), or None."""
    if peephole is None:
        return None
    return _unsqueeze(op.Reshape(_gate_blocks(peephole, "io" if coupled_gates else "ifo", "iof"), [-1]))


def _outputs(Y, Y_h, Y_c):
    """The op's (y, h_n, c_n, saved) from an ONNX node's outputs (Y_c None: GRU / RNN)."""
    c_n = op.Squeeze(Y_c, [0]) if Y_c is not None else op.Squeeze(op.Slice(Y_h, [0], [0], axes=[2]), [0])
    return op.Squeeze(Y, [1]), op.Squeeze(Y_h, [0]), c_n, op.SequenceEmpty()  # saved: nothing in evaluation


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
    _check(W_hr, proj_clip, cell_clip, ln_x_gain, ln_h_gain, zoneout_h, zoneout_c, zoneout_h_mask, zoneout_c_mask,
           recurrent_mask, training)
    src, dst = _gates(mode, coupled_gates)
    hidden = R.shape[1]
    direction = "reverse" if reverse else "forward"
    W_onnx = _unsqueeze(_gate_blocks(W, src, dst))
    R_onnx = _unsqueeze(_gate_blocks(R, src, dst))
    B_onnx = _bias(b_W, b_R, src, dst)
    sequence_lens = op.Cast(lengths, to=6) if lengths is not None else None  # INT32
    initial_h = _unsqueeze(h0)
    if mode == "lstm":
        Y, Y_h, Y_c = op.LSTM(x, W_onnx, R_onnx, B_onnx, sequence_lens, initial_h, _unsqueeze(c0),
                              _peephole(peephole, coupled_gates), hidden_size=hidden, direction=direction,
                              input_forget=int(coupled_gates))
        return _outputs(Y, Y_h, Y_c)
    if mode == "gru":
        Y, Y_h = op.GRU(x, W_onnx, R_onnx, B_onnx, sequence_lens, initial_h, hidden_size=hidden,
                        direction=direction, linear_before_reset=int(reset_after))
    else:
        Y, Y_h = op.RNN(x, W_onnx, R_onnx, B_onnx, sequence_lens, initial_h, hidden_size=hidden,
                        direction=direction, activations=["Relu" if mode == "rnn_relu" else "Tanh"])
    return _outputs(Y, Y_h, None)  # c_n: an empty tensor (GRU / RNN have no cell state)


_UINT8, _INT16 = 2, 5  # ONNX TensorProto data types


def _dynamic_quantize_lstm_schema() -> OpSchema:
    """onnxruntime's com.microsoft.DynamicQuantizeLSTM (its contrib operators' documentation): the
    onnx package knows only the standard domain, and the exporter needs a schema to build a node."""
    param, optional = OpSchema.FormalParameter, OpSchema.FormalParameterOption.Optional
    inputs = [param("X", "T"), param("W", "T2"), param("R", "T2")] + [
        param(name, kind, param_option=optional)
        for name, kind in (("B", "T"), ("sequence_lens", "T1"), ("initial_h", "T"), ("initial_c", "T"), ("P", "T"),
                           ("W_scale", "T"), ("W_zero_point", "T2"), ("R_scale", "T"), ("R_zero_point", "T2"))
    ]
    outputs = [param(name, "T", param_option=optional) for name in ("Y", "Y_h", "Y_c")]
    attr = OpSchema.Attribute
    kind = OpSchema.AttrType
    attributes = [attr("direction", kind.STRING, "forward, reverse or bidirectional", required=False),
                  attr("hidden_size", kind.INT, "H", required=True),
                  attr("input_forget", kind.INT, "couple the input and forget gates", required=False),
                  attr("clip", kind.FLOAT, "cell clip threshold", required=False)]
    types = [("T", ["tensor(float)"], ""), ("T1", ["tensor(int32)"], ""),
             ("T2", ["tensor(uint8)", "tensor(int8)"], "")]
    return OpSchema("DynamicQuantizeLSTM", "com.microsoft", 1, inputs=inputs, outputs=outputs,
                    type_constraints=types, attributes=attributes)


_DYNAMIC_QUANTIZE_LSTM = Op(Opset("com.microsoft", 1), "DynamicQuantizeLSTM", _dynamic_quantize_lstm_schema())


def _uint8_columns(q, scale, src: str, dst: str):
    """int8 rows q [G·H, K] with per-row scales -> ONNX's quantized layout: uint8 [1, K, G·H]
    holding q + 128 (zero point 128: the same values, and onnxruntime's u8 × u8 kernels cannot
    saturate where its u8 × s8 ones, without VNNI, can), the scales [1, G·H] and zero points."""
    columns = op.Transpose(_gate_blocks(q, src, dst), perm=[1, 0])
    shifted = op.Cast(op.Add(op.Cast(columns, to=_INT16), op.Cast(op.Constant(value_int=128), to=_INT16)), to=_UINT8)
    scales = _unsqueeze(_gate_blocks(scale, src, dst))
    rows = q.shape[0] // len(src) * len(dst)  # ONNX's gates (coupled: a zero forget gate added); static
    zero_points = op.Constant(value=onnx.helper.make_tensor("zero_point", _UINT8, [1, rows], [128] * rows))
    return _unsqueeze(shifted), scales, zero_points


def pass_forward_int8(
    x: TFloat, h0: TFloat, c0: Optional[TFloat], W: TTensor, R: TTensor, b_W: Optional[TFloat],
    b_R: Optional[TFloat], W_hr: Optional[TTensor], peephole: Optional[TFloat], ln_x_gain: Optional[TFloat],
    ln_x_shift: Optional[TFloat], ln_h_gain: Optional[TFloat], ln_h_shift: Optional[TFloat],
    ln_c_gain: Optional[TFloat], ln_c_shift: Optional[TFloat], lengths: Optional[TTensor],
    recurrent_mask: Optional[TFloat], zoneout_h_mask: Optional[TFloat], zoneout_c_mask: Optional[TFloat], mode: str,
    zoneout_h: float, zoneout_c: float, cell_clip: Optional[float], proj_clip: Optional[float], coupled_gates: bool,
    reset_after: bool, reverse: bool, W_scale: TFloat, R_scale: TFloat, W_hr_scale: Optional[TFloat],
):
    """One int8 pass (rnnkit::fused_int8_pass) as onnxruntime's com.microsoft.DynamicQuantizeLSTM:
    the same int8 weights and scales (as uint8 with zero point 128), activations quantized by
    onnxruntime its own way (per tensor, unsigned, asymmetric), so outputs agree with rnnkit's
    int8 to int8's tolerance, not bit for bit. LSTM only: onnxruntime has no quantized GRU or RNN."""
    if mode != "lstm":
        family = "GRU" if mode == "gru" else "RNN"
        raise ValueError(f"torch.onnx.export: an int8 {family} has no ONNX operator (onnxruntime's quantized "
                         f"recurrent operator, com.microsoft.DynamicQuantizeLSTM, is LSTM only); export the "
                         f"float model, or keep the {family} in float32")
    _check(W_hr, proj_clip, cell_clip, ln_x_gain, ln_h_gain, zoneout_h, zoneout_c, zoneout_h_mask, zoneout_c_mask,
           recurrent_mask, False)  # int8 passes compute evaluation mode's function
    src, dst = _gates(mode, coupled_gates)
    W_q, W_s, W_z = _uint8_columns(W, W_scale, src, dst)
    R_q, R_s, R_z = _uint8_columns(R, R_scale, src, dst)
    sequence_lens = op.Cast(lengths, to=6) if lengths is not None else None  # INT32
    Y, Y_h, Y_c = _DYNAMIC_QUANTIZE_LSTM(
        x, W_q, R_q, _bias(b_W, b_R, src, dst), sequence_lens, _unsqueeze(h0), _unsqueeze(c0),
        _peephole(peephole, coupled_gates), W_s, W_z, R_s, R_z, hidden_size=R.shape[1],
        direction="reverse" if reverse else "forward", input_forget=int(coupled_gates))
    return _outputs(Y, Y_h, Y_c)
