"""The functional API: argument checks, the stack loop, and cuDNN's four calls.

Layers: a backend runs one layer in one direction (``run_pass``); `rnn` validates
its arguments, draws the masks (``masks.py``), runs the passes of every layer and
direction, and merges their outputs. On top of it sit the cuDNN-style calls
`forward_training`, `forward_inference`, `backward_data` and
`backward_weights`, for code ported from cuDNN.
"""
from __future__ import annotations

import dataclasses
import numbers
from contextlib import nullcontext
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from . import backend as backends_
from .errors import DTypeMismatchError, MismatchError
from .masks import draw_pass, layer_dropout, step_mask
from .native import is_placed
from .params import Layout, PassWeights, check_spec
from .spec import RNNSpec, _flag

State = Union[torch.Tensor, List[torch.Tensor]]


# ---- argument checks -----------------------------------------------------------------

def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def check_tensor(name: str, value, shape: Optional[tuple], like: torch.Tensor) -> torch.Tensor:
    """A tensor of exactly ``shape`` with ``like``'s dtype and device, or a clear error."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor of shape {shape}, got {type(value).__name__}")
    if shape is not None and _shape(value) != tuple(shape):
        raise MismatchError(f"{name}: expected shape {tuple(shape)}, got {_shape(value)}")
    if value.dtype != like.dtype:
        raise DTypeMismatchError(f"{name}: expected dtype {_expected_dtype(like)}, got {value.dtype}")
    if value.device != like.device:
        raise MismatchError(f"{name}: expected a tensor on {like.device} (the device of the weights), got {value.device}")
    return value


def _expected_dtype(like: torch.Tensor) -> str:
    """The dtypes `check_tensor` takes, in words: ``like``'s, or under torch.autocast in its dtype
    float32 too (`_autocast_dtype`'s policy: ``like`` is then the weights as cast, and the input's
    float32 is cast the same way; any other dtype, float64 included, is refused as torch.nn's is)."""
    device = like.device.type
    if device in ("cpu", "cuda") and torch.is_autocast_enabled(device) and like.dtype == torch.get_autocast_dtype(device):
        return f"torch.float32 or {like.dtype} under torch.autocast({device!r}, dtype={like.dtype})"
    return f"{like.dtype} (the dtype the layer computes in)"


def check_cell_states(spec, hx, input: torch.Tensor, like: torch.Tensor) -> tuple:
    """A cell's hx -> (h,) or (h, c), each (B, size) for an input (B, I), (size,) for an input (I,);
    else an error naming the state, the expected and the given shape (the float and int8 cells' check)."""
    cell = spec.cell(0)
    lstm = spec.mode == "lstm"
    if lstm and (not isinstance(hx, (tuple, list)) or len(hx) != 2):
        raise TypeError(f"hx: expected a pair (h, c) for an LSTM cell, got {type(hx).__name__}")
    parts = tuple(hx) if lstm else (hx,)
    sizes = [("h", cell.output_size)] + ([("c", cell.hidden_size)] if lstm else [])
    batch = () if input.dim() == 1 else (input.shape[0],)
    for (name, size), value in zip(sizes, parts):
        check_tensor(f"hx ({name})", value, batch + (size,), like)
    return parts


def _refuse_placed(name: str, tensor: torch.Tensor) -> None:
    """A ValueError naming ``name`` when ``tensor`` is (in) a module's buffer placed as cuDNN places its
    weight space: the functional calls read the spec's layout, and would read it wrong."""
    if is_placed(tensor):
        raise ValueError(f"{name}: expected a buffer in the spec's layout (rnnkit.Layout(spec)), got a module's "
                         "flat_weights (or its gradient) placed as cuDNN places its weight space (a plain stack on "
                         "CUDA; module.flat_offsets): pass torch.cat([w.reshape(-1) for w in "
                         "module.named_weights().values()])")


def check_weights(spec: RNNSpec, weights, layout: Layout) -> torch.Tensor:
    if not isinstance(weights, torch.Tensor):
        raise TypeError(f"weights: expected the packed 1-D parameter tensor, got {type(weights).__name__}")
    _refuse_placed("weights", weights)
    if weights.dim() != 1 or weights.numel() != layout.numel:
        raise MismatchError(f"weights: expected a 1-D tensor of {layout.numel} values for this spec, got shape {_shape(weights)}")
    if not weights.is_floating_point():
        raise TypeError(f"weights: expected a floating-point tensor, got {weights.dtype}")
    return weights


def check_input(spec: RNNSpec, input, weights: torch.Tensor, batch_first: bool, *,
                packed: bool = True) -> Tuple[torch.Tensor, bool]:
    """-> (x time-major [T, B, I], unbatched).

    ``packed``: the caller takes a PackedSequence (and unpacks it before this check), so a
    wrong input's message offers one; `forward_training` takes none.
    """
    layout = "(B, T, input_size)" if batch_first else "(T, B, input_size)"
    if isinstance(input, PackedSequence):  # only a caller that takes none gets one here
        raise TypeError(f"input: expected a padded tensor {layout} with its lengths= here, got a PackedSequence "
                        "(torch.nn.utils.rnn.pad_packed_sequence gives both)")
    if not isinstance(input, torch.Tensor):
        accepted = f"a tensor {layout}" + (" or a PackedSequence" if packed else "")
        raise TypeError(f"input: expected {accepted}, got {type(input).__name__}")
    if input.dim() not in (2, 3):
        raise ValueError(f"input: expected a 3-D tensor {layout} or a 2-D unbatched (T, input_size), got shape {_shape(input)}")
    if input.shape[-1] != spec.input_size:
        raise MismatchError(f"input: expected feature size input_size={spec.input_size} in the last axis, got shape {_shape(input)}")
    check_tensor("input", input, None, weights)
    unbatched = input.dim() == 2
    x = input.unsqueeze(1) if unbatched else (input.transpose(0, 1) if batch_first else input)
    if x.shape[0] == 0:
        raise MismatchError(f"input: expected at least one time step, got shape {_shape(input)}")
    return x, unbatched


def check_lengths(lengths, T: int, B: int, unbatched: bool) -> Optional[torch.Tensor]:
    """-> int64 CPU tensor [B] with 1 <= lengths <= T, or None.

    Under torch.compile / export the values are not read here (that would break the graph); the
    kernels check them instead. Lengths batched by torch.func.vmap are checked all at once.
    """
    if lengths is None:
        return None
    if unbatched:
        raise ValueError("lengths: an unbatched input (T, input_size) has one sequence; pass no lengths")
    if isinstance(lengths, (list, tuple)):
        if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in lengths):
            raise TypeError(f"lengths: expected integers, got {list(lengths)!r}")
        lengths = torch.tensor([int(v) for v in lengths], dtype=torch.int64)
    if not isinstance(lengths, torch.Tensor):
        raise TypeError(f"lengths: expected a 1-D integer tensor or a list of ints, got {type(lengths).__name__}")
    if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise TypeError(f"lengths: expected an integer dtype (e.g. torch.int64), got {lengths.dtype}")
    if lengths.dim() != 1 or lengths.shape[0] != B:
        raise ValueError(f"lengths: expected shape ({B},), one length per sequence in the batch, got {_shape(lengths)}")
    if lengths.device.type == "meta":
        raise ValueError("lengths: expected a tensor holding values (on the CPU or the input's device), got a tensor "
                         "on the meta device")
    lengths = lengths.to("cpu", torch.int64)
    if B and not torch.compiler.is_compiling():
        values = lengths
        while torch._C._functorch.is_functorch_wrapped_tensor(values):  # vmap: every sample's lengths
            values = torch._C._functorch.get_unwrapped(values)
        low, high = int(values.min()), int(values.max())
        if low < 1 or high > T:
            raise ValueError(f"lengths: expected values in [1, T={T}], got min {low}, max {high}")
    return lengths


def _state_shapes(spec: RNNSpec, B: int) -> Tuple[list, list]:
    """Expected shapes of (h_0, c_0): one tensor each, or one per layer with per-layer sizes."""
    D, L = spec.num_directions, spec.num_layers
    if spec.per_layer:
        hs = [(D, B, spec.output_size(k)) for k in range(L)]
        cs = [(D, B, spec.hidden_sizes[k]) for k in range(L)]
    else:
        hs, cs = (L * D, B, spec.output_size(0)), (L * D, B, spec.hidden_sizes[0])
    return hs, cs


def _unbatch_shape(shape, unbatched):
    return tuple(s for i, s in enumerate(shape) if not (unbatched and i == 1))


def _check_state(spec, name: str, value, shape, like, unbatched) -> List[torch.Tensor]:
    """One of h_0 / c_0 in the user's format -> a list of [B, size] per layer-direction."""
    D = spec.num_directions
    if spec.per_layer:
        if not isinstance(value, (list, tuple)) or len(value) != spec.num_layers:
            got = f"{type(value).__name__} of length {len(value)}" if isinstance(value, (list, tuple)) else type(value).__name__
            raise TypeError(f"{name}: expected a list of {spec.num_layers} tensors (one per layer, per-layer sizes), got {got}")
        per_layer = [
            check_tensor(f"{name}[{k}]", v, _unbatch_shape(s, unbatched), like) for k, (v, s) in enumerate(zip(value, shape))
        ]
        tensors = [t.unsqueeze(1) if unbatched else t for t in per_layer]
        return [t[d] for t in tensors for d in range(D)]
    value = check_tensor(name, value, _unbatch_shape(shape, unbatched), like)
    return list((value.unsqueeze(1) if unbatched else value).unbind(0))


def split_states(spec: RNNSpec, hx, x: torch.Tensor, unbatched: bool):
    """User states -> (h0s, c0s): lists over layer-directions of [B, Hr] / [B, H] (c0s None if not LSTM)."""
    B = x.shape[1]
    h_shapes, c_shapes = _state_shapes(spec, B)
    lstm = spec.mode == "lstm"
    if hx is None:
        zeros = lambda shapes: [  # noqa: E731
            x.new_zeros(s[1:]) for s in ([shapes] if not spec.per_layer else shapes) for _ in range(s[0])
        ]
        return zeros(h_shapes), (zeros(c_shapes) if lstm else None)
    if lstm:
        if not isinstance(hx, (tuple, list)) or len(hx) != 2:
            raise TypeError(f"hx: expected a pair (h_0, c_0) for LSTM, got {type(hx).__name__}")
        return (
            _check_state(spec, "hx[0] (h_0)", hx[0], h_shapes, x, unbatched),
            _check_state(spec, "hx[1] (c_0)", hx[1], c_shapes, x, unbatched),
        )
    return _check_state(spec, "hx", hx, h_shapes, x, unbatched), None


def join_states(spec: RNNSpec, hs: List[torch.Tensor], unbatched: bool) -> State:
    """List over layer-directions of [B, ·] -> the user's format (inverse of split_states)."""
    D = spec.num_directions
    if spec.per_layer:
        out = [torch.stack(hs[k * D : (k + 1) * D]) for k in range(spec.num_layers)]
        return [t.squeeze(1) for t in out] if unbatched else out
    out = torch.stack(hs)
    return out.squeeze(1) if unbatched else out


# ---- variable lengths: the batch shrinks as sequences end ------------------------------

# Measured on a 1-thread AMD EPYC (LSTM, lengths spread from T/8 to T: 56% of the T·B steps run),
# time with segments ÷ one pass over every row, inference / training: 0.82 / 0.82 at H 256 B 32,
# 0.76 / 0.77 at H 512 B 64, 0.94 / 0.95 at H 1024 B 32 T 25 (with at most 4 spans; with 8,
# inference read 0.89, 0.75, 1.05: each span packs R again, 16 MB at H 1024). Fewer rows save
# less than their share because every step still reads all of R. At H 128 B 16 a span's fixed
# cost outweighs the rows it saves (1.09), so smaller cells run one pass.
SEGMENTS = 4  # most time segments a pass is split into
SEGMENT_MIN_HIDDEN = 256  # smallest hidden size (of any layer) that segments
SEGMENT_BACKENDS = ("fused", "fused-int8")  # backends with a GEMM per step over every row, which segments shorten
SPAN_CANDIDATES = 256  # most distinct lengths span_ends chooses among (its work and memory grow as their square)


def span_ends(lengths: Sequence[int], count: int) -> List[int]:
    """The ends of at most ``count`` spans of time (the first from 0, each next from the last's end,
    the last at the longest length), among the distinct lengths, that leave the fewest padded
    row-steps: the sum over spans of (end - start) x (rows still going at start). Evenly spaced
    ends left a long tail's last span running the dozen rows longer than its start for all of
    its steps where one row needed them (lengths geometric with mean 50, one of 1000: 14 rows for
    917 steps). Every span costs its fixed work (packing the weights again) however it is cut,
    so the count stays ``count``: a dynamic program over the distinct lengths (n² a step, n ≤ B),
    or over `SPAN_CANDIDATES` of them evenly spaced (the longest among them) where there are more
    (3,000 distinct lengths took 1.25 s and n² memory)."""
    lengths = [int(n) for n in lengths]  # a tensor's elements hash by identity, not value
    distinct = sorted(set(lengths))
    if len(distinct) <= count:
        return distinct
    if len(distinct) > SPAN_CANDIDATES:
        distinct = [distinct[i] for i in sorted({round(k * (len(distinct) - 1) / (SPAN_CANDIDATES - 1))
                                                  for k in range(SPAN_CANDIDATES)})]
    n = len(distinct)
    ends = np.asarray(distinct, dtype=np.int64)
    starts = np.concatenate([[0], ends[:-1]])
    rows = (np.asarray(lengths, dtype=np.int64)[None, :] > starts[:, None]).sum(1)
    # cost[a, j]: a span from the a-th start to the j-th end (j >= a), its padded and real row-steps
    cost = np.where(np.arange(n)[None, :] >= np.arange(n)[:, None], (ends[None, :] - starts[:, None]) * rows[:, None],
                    np.iinfo(np.int64).max // 4)
    best, firsts = cost[0], []  # best[j]: the least cost of spans ending at the j-th end
    for _ in range(count - 1):
        total = best[:-1, None] + cost[1:, :]  # a later span starting at the a-th start, a >= 1
        firsts.append(total.argmin(0) + 1)
        best = np.concatenate([[np.iinfo(np.int64).max // 4], total.min(0)[1:]])
    chosen, j = [], n - 1
    for first in reversed(firsts):
        chosen.append(int(ends[j]))
        j = int(first[j]) - 1
    chosen.append(int(ends[j]))
    return sorted(chosen)


class Segments:
    """A batch sorted by length (longest first) and cut into at most `SEGMENTS` spans of time,
    each run on the rows still going at its start: a prefix of the sorted batch. Rows that end
    inside a span run there with their length relative to it. The work is then about the steps
    that run, not T·B: with lengths spread from T/8 to T, a little over half. So are the copies:
    each span's input is gathered from the caller's x (its padding zeroed there), the layers pass
    their outputs on span by span, and only the last layer's are written into the padded [T, B]
    output (one fill, then the spans' rows): a batch of one long sequence among 127 of length one
    (T 1000, H 256) spent 480 of its 500 ms in passes over the whole padded T x B (zeroing,
    reordering, padding and joining the spans) before.
    """

    def __init__(self, lengths: torch.Tensor, device: torch.device):
        order = torch.argsort(lengths, descending=True, stable=True)
        self.lengths = lengths[order]
        self.order, self.restore = order.to(device), torch.argsort(order).to(device)
        ends = span_ends(self.lengths.tolist(), SEGMENTS)
        self.spans = []  # (start, end, rows, the rows' lengths inside the span or None where all run to its end)
        start = 0
        for end in ends:
            rows = int((self.lengths > start).sum())
            inside = (self.lengths[:rows] - start).clamp(max=end - start)
            self.spans.append((start, end, rows, None if bool((inside == end - start).all()) else inside))
            start = end

    @staticmethod
    def worth_it(backend, spec: RNNSpec, lengths: Optional[torch.Tensor], T: int, training: bool) -> bool:
        """A segmenting backend with cells of hidden size `SEGMENT_MIN_HIDDEN` and more, where at
        least 1/8 of the T·B steps are padding, outside compile / export / tracing and torch.func's
        transforms (vmapped lengths have no values to cut spans at). In training only without
        random masks: they are drawn per row, and sorting the rows would change which row gets
        which draw."""
        if lengths is None or getattr(backend, "name", None) not in SEGMENT_BACKENDS:
            return False
        if training and spec.uses_dropout_masks:
            return False
        if min(spec.cell(layer).hidden_size for layer in range(spec.num_layers)) < SEGMENT_MIN_HIDDEN:
            return False
        if torch.compiler.is_compiling() or torch.compiler.is_exporting() or torch.jit.is_tracing() \
                or torch._C._functorch.peek_interpreter_stack() is not None or lengths.numel() < 2:
            return False
        return (T * lengths.numel() - int(lengths.sum())) * 8 >= T * lengths.numel()

    def inputs(self, x: torch.Tensor) -> list:
        """x [T, B, I] in the caller's order -> per span its rows' steps [end - start, rows, I], in
        sorted order, zero past each row's length (nothing a caller leaves in the padding reaches
        an output or a gradient)."""
        pieces = []
        for start, end, rows, inside in self.spans:
            piece = x[start:end].index_select(1, self.order[:rows])
            pieces.append(piece if inside is None else _zero_padding(piece, inside))
        return pieces

    def run_pass(self, backend, cell, pieces: list, h0, c0, w, reverse: bool, masks):
        """One pass over the sorted batch, span by span (the reverse direction from the last span):
        -> (per span y [end - start, rows, F] zero past each length, h_n, c_n), rows in sorted order."""
        h, c, B = h0, c0, h0.shape[0]
        outputs = [None] * len(self.spans)
        for k in (reversed(range(len(self.spans))) if reverse else range(len(self.spans))):
            _, _, rows, inside = self.spans[k]
            outputs[k], h_span, c_span = backend.run_pass(cell, pieces[k], h[:rows], None if c is None else c[:rows],
                                                          w, inside, reverse, masks)
            h = torch.cat([h_span, h[rows:]]) if rows < B else h_span
            if c is not None:
                c = torch.cat([c_span, c[rows:]]) if rows < B else c_span
        return outputs, h, c

    def output(self, pieces: list, T: int, B: int, padding_unread: bool = False) -> torch.Tensor:
        """The spans' outputs -> y [T, B, F] in the caller's order, zero past each length: one fill
        and the rows that ran (a write into a new tensor, which autograd differentiates through).
        ``padding_unread``: the caller reads only the steps that ran (`sequence_call` packing the
        output), so the padding is left unset and the fill skipped."""
        y = (pieces[0].new_empty if padding_unread else pieces[0].new_zeros)(T, B, pieces[0].shape[2])
        for (start, end, rows, _), piece in zip(self.spans, pieces):
            y[start:end].index_copy_(1, self.order[:rows], piece)
        return y


# ---- the stack -----------------------------------------------------------------------

def _zero_padding(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """x [T, B, F] with the steps t >= lengths[b] zero: nothing a caller leaves in the padding (NaN,
    inf) reaches an output or a gradient."""
    return torch.where(step_mask(lengths, x.shape[0], x.device).unsqueeze(2), x,
                       torch.zeros((), dtype=x.dtype, device=x.device))


def run_stack(backend, spec: RNNSpec, weights: Sequence[PassWeights], x, h0s, c0s, lengths, training,
              padding_unread: bool = False):
    """All layers and directions on time-major x -> (y [T, B, F], h_ns, c_ns).

    ``weights`` has one `PassWeights` per layer-direction (layer by layer, forward
    first); h_ns / c_ns are lists over layer-directions of [B, Hr] / [B, H] (c_ns None unless
    LSTM). With lengths, the input's padding is zeroed first, so that nothing a caller leaves
    there (NaN, inf) reaches an output or a gradient: a batch with lengths equals each sequence
    run alone.
    """
    T, B = x.shape[:2]
    segments = None
    if not hasattr(backend, "run_stack") and Segments.worth_it(backend, spec, lengths, T, training):
        segments = Segments(lengths, x.device)  # each span's input zeroed as it is gathered
        h0s = [h.index_select(0, segments.order) for h in h0s]
        c0s = None if c0s is None else [c.index_select(0, segments.order) for c in c0s]
    elif lengths is not None:
        x = _zero_padding(x, lengths)
    if hasattr(backend, "run_stack"):
        return backend.run_stack(spec, weights, x, h0s, c0s, lengths, training)
    D = spec.num_directions
    # with segments, every layer's input and output a list of the spans' (no random masks there)
    layer_input, h_ns, c_ns = x if segments is None else segments.inputs(x), [], []
    for layer in range(spec.num_layers):
        cell = spec.cell(layer)
        outputs = []
        for direction in range(D):
            i = layer * D + direction
            draw = draw_pass(spec, cell, T, B, x, training)
            w = weights[i]
            if draw.dropconnect is not None:
                w = w._replace(R=w.R * draw.dropconnect)
            inp = layer_input if draw.input is None else layer_input * draw.input
            c0 = c0s[i] if c0s is not None else None
            if segments is not None:
                y, h_n, c_n = segments.run_pass(backend, cell, inp, h0s[i], c0, w, direction == 1, draw.masks)
            else:
                y, h_n, c_n = backend.run_pass(cell, inp, h0s[i], c0, w, lengths, direction == 1, draw.masks)
            outputs.append(y)
            h_ns.append(h_n)
            c_ns.append(c_n)
        if D == 1:
            y = outputs[0]
        elif segments is not None:
            y = [torch.cat(pair, 2) if spec.merge == "concat" else pair[0] + pair[1] for pair in zip(*outputs)]
        else:
            y = torch.cat(outputs, 2) if spec.merge == "concat" else outputs[0] + outputs[1]
        if training and spec.dropout and layer < spec.num_layers - 1:
            y = layer_dropout(y, spec.dropout)
        layer_input = y
    if segments is not None:  # back to the caller's order
        layer_input = segments.output(layer_input, T, B, padding_unread)
        h_ns = [h.index_select(0, segments.restore) for h in h_ns]
        c_ns = [c.index_select(0, segments.restore) for c in c_ns] if spec.mode == "lstm" else c_ns
    return layer_input, h_ns, (c_ns if spec.mode == "lstm" else None)


def _to_dtype(tree, dtype: torch.dtype):
    """float32 tensors of a nested state / input cast to ``dtype`` (anything else as it is)."""
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_dtype(t, dtype) for t in tree)
    if isinstance(tree, torch.Tensor) and tree.dtype == torch.float32:
        return tree.to(dtype)
    return tree


def _autocast_on(device: torch.device) -> bool:
    """Whether torch.autocast is on for ``device`` (the CPU's and CUDA's: the two rnnkit runs on)."""
    return device.type in ("cpu", "cuda") and torch.is_autocast_enabled(device.type)


def _autocast_dtype(device: torch.device, dtype: torch.dtype) -> Optional[torch.dtype]:
    """The lower-precision dtype the stack runs in under torch.autocast, or None.

    The policy, the same for every configuration and backend: under ``torch.autocast`` for the
    input's device, float32 inputs, states and weights are cast to the autocast dtype, the stack
    runs in that dtype (each backend computes at least as precisely: the fused CPU kernels keep
    accumulation, pointwise math and the carried state in float32), and y and the final states
    come back in it, as torch.nn's RNNs do under autocast. A module already in the autocast dtype
    takes float32 inputs and states the same way (as torch.nn's does). float64 is left alone, and
    so is a module in another half-precision dtype.
    """
    if not _autocast_on(device):
        return None
    low = torch.get_autocast_dtype(device.type)
    return low if dtype in (torch.float32, low) else None


def run(
    spec: RNNSpec,
    weights: Sequence[PassWeights],
    input: torch.Tensor,
    hx=None,
    lengths=None,
    *,
    training: bool,
    backend,
    batch_first: bool,
    like: torch.Tensor,
    padding_unread: bool = False,
):
    """`rnn` with the weights given per pass (the modules' entry) -> (y, hy, backend name).

    ``like`` is a weight tensor: the input must have its dtype and device. ``backend`` is a
    registered backend's name, or a backend object that runs the call as given (autocast does not
    apply: rnnkit.quantize's int8 modules, whose weights are not floating point).
    ``padding_unread``: the caller reads y only at the steps that ran (`sequence_call`), so its
    padding may be left unset.
    """
    if torch.compiler.is_exporting():
        from .interop import onnx_ops

        if onnx_ops.exporting():  # the pass ops become ONNX LSTM / GRU / RNN nodes
            onnx_ops.check_exportable(spec)
            drawn = spec.random_options  # zoneout: refused by check_exportable in either mode
            if training and drawn:  # the masks would be drawn in the graph, anew at every run
                raise ValueError(f"torch.onnx.export: {drawn[0]} draws random masks in training mode; the model must "
                                 "be exported in evaluation mode (model.eval())")
    named = isinstance(backend, str)
    low = _autocast_dtype(like.device, like.dtype) if named else None
    if low is not None:  # inputs and states in float32 or the autocast dtype are taken, as torch.nn does
        input, hx = _to_dtype(input, low), _to_dtype(hx, low)
        weights = [PassWeights(*(None if t is None else t.to(low) for t in w)) for w in weights]
        like = weights[0].W
    x, unbatched = check_input(spec, input, like, batch_first)
    lengths = check_lengths(lengths, x.shape[0], x.shape[1], unbatched)
    h0s, c0s = split_states(spec, hx, x, unbatched)
    if named:
        tensors = (x, *h0s, *(c0s or ()), *(t for w in weights for t in w))
        grad = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)
        chosen = backends_.select(backend, spec, x.device, x.dtype, steps=x.shape[0], grad=grad, batch=x.shape[1],
                                  lengths=lengths is not None)
    else:
        chosen = backend
    # Under autocast the stack runs as the policy says and nowhere else: a module in the autocast
    # dtype or cast to it (low), and one left alone (float64, another half dtype), whose products
    # autocast would otherwise move to its dtype (a float16 module's to bfloat16) or refuse to join
    shielded = named and _autocast_on(x.device)
    with torch.autocast(x.device.type, enabled=False) if shielded else nullcontext():
        y, h_ns, c_ns = run_stack(chosen, spec, weights, x, h0s, c0s, lengths, training, padding_unread)
        if unbatched:
            y = y.squeeze(1)
        elif batch_first:
            y = y.transpose(0, 1)
        h_n = join_states(spec, h_ns, unbatched)
        c_n = join_states(spec, c_ns, unbatched) if spec.mode == "lstm" else None
    if spec.mode == "lstm":
        return y, (h_n, c_n), chosen.name
    return y, h_n, chosen.name


def rnn(
    spec: RNNSpec,
    weights: torch.Tensor,
    input: torch.Tensor,
    hx=None,
    lengths=None,
    *,
    training: bool = False,
    backend: str = "auto",
    layout: Optional[Layout] = None,
    batch_first: Optional[bool] = None,
):
    """Run a recurrent stack: the one entry point the modules and the cuDNN-style calls share.

    Args:
        spec: the stack's `RNNSpec`.
        weights: the packed 1-D parameter buffer (``Layout(spec).numel`` values).
        input: (T, B, I), or (B, T, I) with ``batch_first``, or unbatched (T, I); or a
            PackedSequence (time-major data, lengths=None), and then y is one, packed the same way.
        hx: initial states, zeros when None. GRU/RNN: h_0 (L·D, B, Hr); LSTM: (h_0, c_0) with
            c_0 (L·D, B, H). With per-layer sizes each is a list of L tensors (D, B, Hr_k).
        lengths: (B,) integers in [1, T], in any order; steps t >= length output zeros and
            leave the state alone.
        training: draw dropout / zoneout masks (True) or use the expectation (False).
        backend: "auto", "reference", or another registered backend's name.
        layout: ``Layout(spec)``, made once by a caller that runs the same spec often; built
            here when None. It must be this spec's (``layout.spec == spec``).
        batch_first: overrides ``spec.batch_first``.

    Returns:
        (y, h_n) or, for LSTM, (y, (h_n, c_n)); y is (T, B, D·Hr) (``merge="sum"``: Hr).
    """
    check_spec(spec)
    training = _flag("training", training)
    batch_first = None if batch_first is None else _flag("batch_first", batch_first)
    if not isinstance(backend, str):  # a name here: backend objects are the modules' (run)
        raise TypeError(f"backend: expected one of {tuple(backends_.names())}, got {type(backend).__name__} {backend!r}")
    if layout is None:
        layout = Layout(spec)
    elif not isinstance(layout, Layout):
        raise TypeError(f"layout: expected an rnnkit.Layout (Layout(spec)) or None, got {type(layout).__name__}")
    elif layout.spec != spec:
        differ = [f.name for f in dataclasses.fields(spec) if getattr(spec, f.name) != getattr(layout.spec, f.name)]
        theirs = ", ".join(f"{name}={getattr(layout.spec, name)!r}" for name in differ)
        ours = ", ".join(f"{name}={getattr(spec, name)!r}" for name in differ)
        raise ValueError(f"layout: expected the layout of this spec (Layout(spec)), got one of a spec with {theirs}; "
                         f"spec has {ours}")
    batch_first = spec.batch_first if batch_first is None else batch_first
    check_weights(spec, weights, layout)
    passes = layout.all_pass_weights(weights)

    def run_padded(x, h0, lens, x_batch_first, padding_unread=False):  # a PackedSequence arrives padded
        y, hy, _ = run(spec, passes, x, h0, lens, training=training, backend=backend, batch_first=x_batch_first,
                       like=weights, padding_unread=padding_unread)
        return y, hy

    return sequence_call(run_padded, input, hx, lengths, batch_first)


def _check_packed(input: PackedSequence) -> None:
    """A PackedSequence whose data has the rows its batch_sizes promise: torch's
    pack_padded_sequence does not check lengths against the padded input's T, and one built
    with longer lengths failed deep inside unpacking."""
    data, sizes = input.data, input.batch_sizes
    if not isinstance(data, torch.Tensor) or data.dim() != 2:
        raise MismatchError(f"input: expected a PackedSequence with 2-D data (rows, input_size), got data of shape "
                            f"{tuple(getattr(data, 'shape', ()))}")
    if torch.compiler.is_compiling() or sizes.device.type == "meta":
        return
    total = int(sizes.sum())
    if total != data.shape[0] or (sizes.numel() and (int(sizes.min()) < 1 or bool((sizes[1:] > sizes[:-1]).any()))):
        raise MismatchError(
            f"input: a PackedSequence whose batch_sizes ({sizes[:8].tolist()}{'...' if sizes.numel() > 8 else ''}, "
            f"sum {total}) do not describe its {data.shape[0]} data rows; was it packed with lengths longer than "
            "the padded input?")


def sequence_call(run, input, hx, lengths, batch_first: bool):
    """The stacks' call convention around ``run(input, hx, lengths, batch_first) -> (y, hy)``: a
    PackedSequence input is run padded with its lengths (``run(..., padding_unread=True)``: its
    output's padding is not read), and its output packed the same way. The
    padded batch stays in the packed order (longest first), the states permuted into it and back
    as torch.nn's are: unsorting the padded input and sorting the output again were two passes
    over the whole padded T x B."""
    if isinstance(input, PackedSequence):
        if lengths is not None:
            raise ValueError("lengths: a PackedSequence carries its own lengths; pass lengths=None")
        _check_packed(input)
        order, unorder = input.sorted_indices, input.unsorted_indices
        if torch.compiler.is_compiling() or input.data.device.type == "meta":
            padded, lens = pad_packed_sequence(PackedSequence(input.data, input.batch_sizes))  # [T, B, I], packed order
            B = padded.shape[1]
            y, hy = run(padded, _batch_permuted(hx, order, B), lens, False)
            data = pack_padded_sequence(y, lens, enforce_sorted=True).data
        else:  # the padding left unset (every backend zeroes or skips it, as a caller's NaN there), and not read back
            sizes = input.batch_sizes
            T, B = sizes.numel(), int(sizes[0]) if sizes.numel() else 0
            ran = (torch.arange(B)[None, :] < sizes[:, None]).flatten().nonzero().squeeze(1)  # packed data's order
            lens = (sizes[None, :] > torch.arange(B)[:, None]).sum(1)
            padded = input.data.new_empty(T * B, input.data.shape[1])
            padded.index_copy_(0, ran.to(input.data.device), input.data)
            padded = padded.view(T, B, input.data.shape[1])
            y, hy = run(padded, _batch_permuted(hx, order, B), lens, False, padding_unread=True)
            data = y.reshape(T * B, y.shape[2]).index_select(0, ran.to(y.device))
        return PackedSequence(data, input.batch_sizes, order, unorder), _batch_permuted(hy, unorder, B)
    return run(input, hx, lengths, batch_first)


def _batch_permuted(states, index: Optional[torch.Tensor], B: int):
    """Stacked states (a tensor, an LSTM's pair, per-layer lists; batch on dim 1) with their batch
    permuted by ``index``; anything else, or a tensor of another batch size, as it is (the state
    checks then refuse it by name, rather than a permutation picking rows of it)."""
    if index is None or states is None:
        return states
    if isinstance(states, (tuple, list)):
        return type(states)(_batch_permuted(t, index, B) for t in states)
    if isinstance(states, torch.Tensor) and states.dim() >= 2 and states.shape[1] == B:
        return states.index_select(1, index.to(states.device))
    return states


# ---- cuDNN's four calls --------------------------------------------------------------

def _leaves(tree):
    return [t for t in (tree if isinstance(tree, (list, tuple)) else [tree]) for t in (t if isinstance(t, (list, tuple)) else [t])]


def _map(tree, fn):
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map(t, fn) for t in tree)
    return fn(tree)


def detach_state(state):
    """A final state with its values kept and its graph cut, for truncated BPTT: the next chunk
    starts from these values and backpropagates no further back. Takes every form a module
    returns (a tensor; an LSTM's ``(h_n, c_n)``; per-layer lists) and None.

    Example:
        >>> lstm = rnnkit.LSTM(8, [16, 12], num_layers=2)
        >>> y, state = lstm(torch.randn(5, 3, 8))
        >>> state = rnnkit.detach_state(state)    # ([h_l0, h_l1], [c_l0, c_l1]), no graph
    """
    if state is None:
        return None
    if not all(isinstance(t, torch.Tensor) for t in _leaves(state)):
        raise TypeError(f"state: expected a module's final state (tensors, tuples and lists of them), got "
                        f"{type(state).__name__}")
    return _map(state, torch.Tensor.detach)


def _zero_state(spec: RNNSpec, x_time_major: torch.Tensor, unbatched: bool):
    h0s, c0s = split_states(spec, None, x_time_major, unbatched)
    h = join_states(spec, h0s, unbatched)
    return (h, join_states(spec, c0s, unbatched)) if spec.mode == "lstm" else h


def _leaf(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a new leaf that requires grad. An inference tensor is copied: autograd
    records nothing on one."""
    return (t.clone() if t.is_inference() else t.detach()).requires_grad_(True)


class Reserve:
    """What `backward_data` and `backward_weights` need from `forward_training`.

    Opaque; it holds the recorded computation until backward_data frees it.
    """

    def __init__(self, spec, inputs, weights, outputs):
        self.spec = spec
        self._inputs = inputs  # (x, hx)
        self._weights = weights
        self._outputs = outputs  # (y, hy)
        self._dweights: Optional[torch.Tensor] = None


def forward_training(spec: RNNSpec, weights: torch.Tensor, input: torch.Tensor, hx=None, lengths=None, *, backend: str = "auto"):
    """Forward pass in training mode that records what backward needs (cudnnRNNForwardTraining).

    Shapes as in `rnn`, in the layout ``spec.batch_first`` says (there is no ``batch_first``
    argument), with a padded tensor input (a PackedSequence is refused: pad it and pass its
    lengths). Dropouts and zoneout draw their masks. The reserve reads ``input``, ``hx`` and
    ``weights`` as given, not copies (as cuDNN's reads its buffers): change none of them in place
    before `backward_data`. The returned ``y`` and states are the caller's to change. Not under
    torch.inference_mode(), which records nothing for backward (`forward_inference` is the call
    there); inference tensors made under it are taken outside it (copied).

    Returns:
        (y, hy, reserve): ``hy`` is h_n, or (h_n, c_n) for LSTM; pass ``reserve`` to
        `backward_data` and then `backward_weights`.

    Example:
        >>> y, hy, reserve = forward_training(spec, w, x)
        >>> dx, dhx, dcx = backward_data(reserve, dy)
        >>> dw = backward_weights(reserve)
    """
    if torch.is_inference_mode_enabled():
        raise RuntimeError("forward_training: called under torch.inference_mode(), which records nothing for "
                           "backward_data; call it outside inference mode, or use forward_inference")
    layout = Layout(spec)
    check_weights(spec, weights, layout)
    # checked as rnn checks them: under torch.autocast after its policy's casts (`_autocast_dtype`)
    low = _autocast_dtype(weights.device, weights.dtype)
    like = weights if low is None else weights.new_empty(0, dtype=low)
    cast = (lambda tree: tree) if low is None else (lambda tree: _to_dtype(tree, low))  # noqa: E731
    x_tm, unbatched = check_input(spec, cast(input), like, spec.batch_first, packed=False)
    if hx is None:
        hx = _zero_state(spec, x_tm, unbatched)
    for state in _leaves(hx):  # as rnn checks them, before autograd is asked to track an integer tensor
        if isinstance(state, torch.Tensor):
            check_tensor("hx", cast(state), None, like)
    x_leaf = _leaf(input)
    hx_leaf = _map(hx, lambda t: _leaf(t) if isinstance(t, torch.Tensor) else t)
    w_leaf = _leaf(weights)
    with torch.enable_grad():
        y, hy = rnn(spec, w_leaf, x_leaf, hx_leaf, lengths, training=True, backend=backend, layout=layout)
    reserve = Reserve(spec, (x_leaf, hx_leaf), w_leaf, (y, hy))
    # y the caller's own: a backend may keep y for its backward (the fused ops do), and a y that
    # shared its memory could not be masked or edited in place before backward_data
    return y.detach().clone(), _map(hy, torch.Tensor.detach), reserve


def forward_inference(spec: RNNSpec, weights: torch.Tensor, input: torch.Tensor, hx=None, lengths=None, *, backend: str = "auto"):
    """Forward pass in inference mode, keeping no per-step activations (cudnnRNNForwardInference).

    Zoneout uses its expectation; dropouts are off. Arguments and (y, hy) as `rnn` (a PackedSequence
    input too).
    """
    with torch.no_grad():
        return rnn(spec, weights, input, hx, lengths, training=False, backend=backend)


def _output_grad(name: str, grad, out: torch.Tensor) -> torch.Tensor:
    """The gradient of an output: ``out``'s shape, device and dtype, or float32 for a bfloat16 /
    float16 output (a forward under torch.autocast), rounded to it as autograd rounds a gradient."""
    if isinstance(grad, torch.Tensor) and grad.dtype == torch.float32 and out.dtype in (torch.bfloat16, torch.float16):
        check_tensor(name, grad, _shape(out), out.new_empty(0, dtype=torch.float32))
        return grad.to(out.dtype)
    if isinstance(grad, torch.Tensor) and grad.dtype != out.dtype:
        half = " (or float32)" if out.dtype in (torch.bfloat16, torch.float16) else ""
        raise DTypeMismatchError(f"{name}: expected dtype {out.dtype}{half}, the dtype of the output it is the "
                                 f"gradient of, got {grad.dtype}")
    return check_tensor(name, grad, _shape(out), out)


def backward_data(reserve: Reserve, dy: torch.Tensor, dhy=None, dcy=None):
    """Gradients with respect to the input and the initial states (cudnnRNNBackwardData).

    Args:
        reserve: from `forward_training`; consumed (call once).
        dy: gradient of y, shaped like y.
        dhy: gradient of h_n, shaped like h_n (None = zeros).
        dcy: gradient of c_n for LSTM (None = zeros).

    Returns:
        (dx, dhx, dcx): shaped like the input, h_0 and c_0 (dcx is None unless LSTM).
    """
    if not isinstance(reserve, Reserve):
        raise TypeError(f"reserve: expected the Reserve returned by forward_training, got {type(reserve).__name__}")
    if reserve._outputs is None:
        raise RuntimeError("reserve: backward_data was already called with this reserve (it is consumed)")
    spec = reserve.spec
    lstm = spec.mode == "lstm"
    if dcy is not None and not lstm:
        raise ValueError(f"dcy: only LSTM has a cell state, got mode={spec.mode!r}")
    y, hy = reserve._outputs
    h_n, c_n = hy if lstm else (hy, None)
    pairs = [(y, _output_grad("dy", dy, y))]
    for name, grad, out in (("dhy", dhy, h_n), ("dcy", dcy, c_n)):
        if grad is None:
            continue
        if isinstance(out, list):
            if not isinstance(grad, (list, tuple)) or len(grad) != len(out):
                raise TypeError(f"{name}: expected a list of {len(out)} tensors like the final states")
            pairs += [(o, _output_grad(f"{name}[{k}]", g, o)) for k, (o, g) in enumerate(zip(out, grad))]
        else:
            pairs.append((out, _output_grad(name, grad, out)))
    x, hx = reserve._inputs
    inputs = [x] + _leaves(hx) + [reserve._weights]
    try:
        grads = torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True)
    except RuntimeError as error:
        if "inplace" not in str(error).replace("in-place", "inplace").replace("in place", "inplace"):
            raise
        raise RuntimeError("backward_data: the input, hx or weights given to forward_training were changed in place "
                           "since; the reserve reads them as they are, not copies (as cuDNN's reads its buffers): "
                           "keep them unchanged until backward_data, or pass copies") from error
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip(inputs, grads)]
    reserve._dweights = grads[-1]
    reserve._outputs = None
    state_grads = iter(grads[1:-1])
    dhx = _map(hx, lambda _: next(state_grads))
    if lstm:
        return grads[0], dhx[0], dhx[1]
    return grads[0], dhx, None


def backward_weights(reserve: Reserve, dweights: Optional[torch.Tensor] = None, *, accumulate: bool = False) -> torch.Tensor:
    """Gradient with respect to the packed weights (cudnnRNNBackwardWeights).

    Call after `backward_data` with the same reserve.

    Args:
        dweights: a packed buffer to write into (shape and dtype of the weights); a new
            one is returned when None.
        accumulate: add into ``dweights`` (cuDNN's CUDNN_WGRAD_MODE_ADD) instead of
            overwriting it (CUDNN_WGRAD_MODE_SET); needs ``dweights``.
    """
    if not isinstance(reserve, Reserve):
        raise TypeError(f"reserve: expected the Reserve returned by forward_training, got {type(reserve).__name__}")
    if reserve._dweights is None:
        raise RuntimeError("reserve: call backward_data before backward_weights (as with cuDNN)")
    grad = reserve._dweights
    accumulate = _flag("accumulate", accumulate)
    if dweights is None:
        if accumulate:
            raise ValueError("accumulate: True adds the gradient into dweights, got dweights=None; pass the buffer "
                             "to add into, or accumulate=False for a new one")
        return grad.clone()
    _refuse_placed("dweights", dweights)
    check_tensor("dweights", dweights, _shape(grad), grad)
    if dweights.numel() > 1 and 0 in dweights.stride():
        raise ValueError(f"dweights: expected a buffer of its own memory, got an expanded tensor (stride "
                         f"{dweights.stride()}: one value stands for them all)")
    with torch.no_grad():
        return dweights.add_(grad) if accumulate else dweights.copy_(grad)
