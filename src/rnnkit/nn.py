"""Drop-in modules ``LSTM``, ``GRU``, ``RNN`` and the one-step cells. Thin: the work is in functional.py."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from . import backend as backends_
from . import functional as F
from .params import Layout, initialize
from .spec import RNNSpec


def _bias_mode(bias, bias_mode: Optional[str]) -> str:
    if not isinstance(bias, bool):
        raise TypeError(f"bias: expected a bool, got {type(bias).__name__} {bias!r}")
    if bias_mode is None:
        return "double" if bias else "none"
    if not bias and bias_mode != "none":
        raise ValueError(f"bias_mode: bias=False means bias_mode='none', got bias_mode={bias_mode!r}")
    return bias_mode


class _PackedModule(nn.Module):
    """A module whose parameters live in one packed buffer ``flat_weights``.

    The buffer's pieces are reachable as attributes and in ``state_dict`` under torch.nn's
    names (see params.py), so torch.nn checkpoints load and save without conversion.
    """

    spec: RNNSpec
    layout: Layout

    def _init_packed(self, spec: RNNSpec, suffixes: bool, backend: str, forget_bias, device, dtype) -> None:
        self.spec = spec
        self.layout = Layout(spec, suffixes=suffixes)
        self.backend = backends_.check_name(backend)
        if backend != "auto":
            reason = backends_.get(backend).unavailable_reason()
            if reason:
                raise backends_.BackendUnavailableError(f"backend={backend!r} cannot run here: {reason}")
        self.flat_weights = nn.Parameter(torch.empty(self.layout.numel, device=device, dtype=dtype))
        self.reset_parameters(forget_bias=forget_bias)

    def reset_parameters(self, forget_bias: Optional[float] = None) -> None:
        """Re-draw the weights as torch.nn does (uniform ±1/sqrt(H)); LN gains 1, shifts 0."""
        initialize(self.layout, self.flat_weights.data, forget_bias=forget_bias)

    def __getattr__(self, name: str):
        layout = self.__dict__.get("layout")
        if layout is not None and name in layout.index:
            return layout.view(self.flat_weights, name)
        return super().__getattr__(name)

    def __setattr__(self, name: str, value) -> None:
        layout = self.__dict__.get("layout")
        if layout is not None and name in layout.index:
            raise AttributeError(
                f"{name} is a view into the packed buffer flat_weights; copy into it instead: "
                f"module.{name}.data.copy_(value), or use load_state_dict"
            )
        super().__setattr__(name, value)

    def flatten_parameters(self) -> None:
        """No-op, for code written for torch.nn: the parameters are always one flat buffer."""

    def named_weights(self):
        """{torch.nn name: view into flat_weights} for every piece, in buffer order."""
        return self.layout.named_views(self.flat_weights)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name, view in self.layout.named_views(self.flat_weights).items():
            destination[prefix + name] = view if keep_vars else view.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        with torch.no_grad():
            for entry in self.layout:
                key = prefix + entry.name
                if key not in state_dict:
                    missing_keys.append(key)
                    continue
                value = state_dict[key]
                if not isinstance(value, torch.Tensor) or tuple(value.shape) != entry.shape:
                    got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                    error_msgs.append(
                        f"size mismatch for {key}: copying a param with shape {got} from checkpoint, "
                        f"the shape in current model is {entry.shape}."
                    )
                    continue
                self.layout.view(self.flat_weights, entry.name).copy_(value)
        if strict:
            for key in state_dict:
                if key.startswith(prefix) and key[len(prefix):] not in self.layout.index and "." not in key[len(prefix):]:
                    unexpected_keys.append(key)


class _Recurrent(_PackedModule):
    def __init__(
        self,
        mode: str,
        input_size: int,
        hidden_size,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        *,
        bias_mode: Optional[str] = None,
        forget_bias: Optional[float] = None,
        backend: str = "auto",
        device=None,
        dtype=None,
        **options,
    ):
        super().__init__()
        spec = RNNSpec(
            mode,
            input_size,
            hidden_size,
            num_layers,
            bidirectional=bidirectional,
            bias_mode=_bias_mode(bias, bias_mode),
            dropout=dropout,
            batch_first=batch_first,
            **options,
        )
        self._init_packed(spec, True, backend, forget_bias, device, dtype)
        # torch.nn's attribute names, for code that reads them
        self.mode, self.input_size, self.num_layers = mode, input_size, num_layers
        self.hidden_size = hidden_size
        self.proj_size = options.get("proj_size", 0)
        self.bias, self.batch_first, self.dropout, self.bidirectional = bias, batch_first, dropout, bidirectional

    def forward(self, input, hx=None, lengths=None):
        """Run the stack over a sequence.

        Args:
            input: (T, B, input_size), (B, T, input_size) with batch_first, (T, input_size)
                unbatched, or a PackedSequence.
            hx: initial state (zeros when None); see :func:`rnnkit.functional.rnn` for shapes.
            lengths: (B,) valid lengths of a padded tensor input, in any order.

        Returns:
            (output, h_n), or (output, (h_n, c_n)) for LSTM; output is a PackedSequence
            when the input is one.
        """
        if not isinstance(input, PackedSequence):
            return F.rnn(
                self.spec, self.flat_weights, input, hx, lengths,
                training=self.training, backend=self.backend, layout=self.layout,
            )
        if lengths is not None:
            raise ValueError("lengths: a PackedSequence carries its own lengths; pass lengths=None")
        padded, lens = pad_packed_sequence(input)  # [T, B, I], batch in original order
        y, hy = F.rnn(
            self.spec, self.flat_weights, padded, hx, lens,
            training=self.training, backend=self.backend, layout=self.layout, batch_first=False,
        )
        order = input.sorted_indices
        if order is not None:
            y, lens = y.index_select(1, order), lens[order.cpu()]
        data = pack_padded_sequence(y, lens, enforce_sorted=True).data
        return PackedSequence(data, input.batch_sizes, input.sorted_indices, input.unsorted_indices), hy

    @property
    def all_weights(self):
        """torch.nn's list of per-layer-direction weight lists (views into the buffer)."""
        D = self.spec.num_directions
        return [
            [self.layout.view(self.flat_weights, e.name) for e in self.layout if e.layer * D + e.direction == i]
            for i in range(self.spec.num_layers * D)
        ]

    def extra_repr(self) -> str:
        defaults = RNNSpec(self.spec.mode, 1, 1).options()
        shown = {"input_size", "hidden_size"}
        parts = [f"{self.spec.input_size}, {self.hidden_size}"]
        for key, value in self.spec.options().items():
            if key not in shown and key != "mode" and value != defaults[key]:
                parts.append(f"{key}={value!r}")
        if self.backend != "auto":
            parts.append(f"backend={self.backend!r}")
        return ", ".join(parts)


_OPTIONS_DOC = """
    Beyond torch.nn's arguments, keyword options (SPEC.md has the equations):
        bias_mode: "double" (default), "single_input", "single_recurrent" or "none".
        merge: how bidirectional outputs combine, "concat" (default) or "sum".
        input_dropout, recurrent_dropout: variational dropout on each layer's input and
            on the h entering R, one mask per sequence.
        dropconnect: DropConnect on R, one mask per forward call.
        zoneout: probability of keeping the old h{zc} in training; expectation in eval.
        layer_norm: layer-normalize the input and recurrent pre-activations{lnc}.
        backend: "auto" (fastest available), "reference", or another registered backend.
        device, dtype: where and in what type the packed buffer is made.

    ``hidden_size`` may be a list with one entry per layer; states are then per-layer lists.
    All parameters live in one packed tensor ``flat_weights``; ``weight_ih_l0`` etc. are
    views of it, and ``state_dict()`` uses torch.nn's names.
"""


class LSTM(_Recurrent):
    """Multi-layer LSTM, a drop-in for :class:`torch.nn.LSTM` with every variant of SPEC.md.

    Gates i, f, g, o (cuDNN / PyTorch order)::

        i, f, g, o = σ, σ, tanh, σ of (W x + b_W + R h + b_R)   (+ peepholes on i, f, o)
        c' = f ∘ c + i ∘ g,  h' = o ∘ tanh(c')                  (h' = W_hr h' with proj_size)

    LSTM-only options: proj_size (int or per-layer list), peephole, coupled_gates (f = 1 − i),
    cell_clip, proj_clip, forget_bias (initial forget-gate bias).
    {options}
    Example:
        >>> lstm = rnnkit.LSTM(10, 20, num_layers=2, peephole=True, zoneout=0.1)
        >>> y, (h_n, c_n) = lstm(torch.randn(5, 3, 10))    # y: (5, 3, 20), h_n: (2, 3, 20)
    """

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, batch_first=False, dropout=0.0,
                 bidirectional=False, proj_size=0, **options):
        super().__init__("lstm", input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
                         proj_size=proj_size, **options)


class GRU(_Recurrent):
    """Multi-layer GRU, a drop-in for :class:`torch.nn.GRU` with every variant of SPEC.md.

    Gates r, z, n (cuDNN / PyTorch order)::

        r, z = σ(W_r x + b_Wr + R_r h + b_Rr), σ(W_z x + b_Wz + R_z h + b_Rz)
        n = tanh(W_n x + b_Wn + r ∘ (R_n h + b_Rn))        reset_after=True (default)
        n = tanh(W_n x + b_Wn + R_n (r ∘ h) + b_Rn)        reset_after=False
        h' = (1 − z) ∘ n + z ∘ h
    {options}
    Example:
        >>> gru = rnnkit.GRU(10, 20, bidirectional=True, reset_after=False)
        >>> y, h_n = gru(torch.randn(5, 3, 10))             # y: (5, 3, 40), h_n: (2, 3, 20)
    """

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, batch_first=False, dropout=0.0,
                 bidirectional=False, **options):
        super().__init__("gru", input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
                         **options)


class RNN(_Recurrent):
    """Multi-layer Elman RNN, a drop-in for :class:`torch.nn.RNN`: h' = act(W x + b_W + R h + b_R).

    ``nonlinearity`` is "tanh" (default) or "relu".
    {options}
    Example:
        >>> rnn = rnnkit.RNN(10, 20, nonlinearity="relu", layer_norm=True)
        >>> y, h_n = rnn(torch.randn(5, 3, 10))
    """

    def __init__(self, input_size, hidden_size, num_layers=1, nonlinearity="tanh", bias=True, batch_first=False,
                 dropout=0.0, bidirectional=False, **options):
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"nonlinearity: expected 'tanh' or 'relu', got {nonlinearity!r}")
        super().__init__(f"rnn_{nonlinearity}", input_size, hidden_size, num_layers, bias, batch_first, dropout,
                         bidirectional, **options)
        self.nonlinearity = nonlinearity


LSTM.__doc__ = LSTM.__doc__.format(options=_OPTIONS_DOC.format(zc=" (or a pair for h and c)", lnc=", and c"))
GRU.__doc__ = GRU.__doc__.format(options=_OPTIONS_DOC.format(zc="", lnc=""))
RNN.__doc__ = RNN.__doc__.format(options=_OPTIONS_DOC.format(zc="", lnc=""))


# ---- cells: one step, for generation --------------------------------------------------

class _Cell(_PackedModule):
    def __init__(self, mode, input_size, hidden_size, bias=True, *, bias_mode=None, forget_bias=None,
                 backend="auto", device=None, dtype=None, **options):
        super().__init__()
        sequence_level = sorted(set(options) & {"input_dropout", "recurrent_dropout", "dropconnect", "dropout",
                                                "bidirectional", "merge", "num_layers", "batch_first"})
        if sequence_level:
            raise TypeError(
                f"{sequence_level[0]}: a per-sequence option, which a one-step cell does not take; "
                "use rnnkit.LSTM / GRU / RNN (or apply the mask to the cell's input yourself)"
            )
        spec = RNNSpec(mode, input_size, hidden_size, 1, bias_mode=_bias_mode(bias, bias_mode), **options)
        self._init_packed(spec, False, backend, forget_bias, device, dtype)
        self.input_size, self.hidden_size, self.bias = input_size, hidden_size, bias

    def _step(self, input, hx):
        spec = self.spec
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"input: expected a tensor (B, input_size) or (input_size,), got {type(input).__name__}")
        if input.dim() not in (1, 2):
            raise ValueError(f"input: expected a 2-D tensor (B, input_size) or 1-D (input_size,), got shape {tuple(input.shape)}")
        if input.shape[-1] != spec.input_size:  # checked here so the message shows the caller's shape
            raise ValueError(f"input: expected feature size input_size={spec.input_size} in the last axis, got shape {tuple(input.shape)}")
        unbatched = input.dim() == 1
        B = 1 if unbatched else input.shape[0]
        cell = spec.cell(0)
        shapes = [("h", (B, cell.output_size))] + ([("c", (B, cell.hidden_size))] if spec.mode == "lstm" else [])
        if hx is not None:
            parts = hx if spec.mode == "lstm" else (hx,)
            if spec.mode == "lstm" and (not isinstance(hx, (tuple, list)) or len(hx) != 2):
                raise TypeError(f"hx: expected a pair (h, c) for an LSTM cell, got {type(hx).__name__}")
            for (name, shape), value in zip(shapes, parts):
                F.check_tensor(f"hx ({name})", value, shape[1:] if unbatched else shape, self.flat_weights)
            hx = tuple(p.reshape(1, B, -1) for p in parts)
            hx = hx if spec.mode == "lstm" else hx[0]
        x = input.reshape(1, B, -1)
        _, hy = F.rnn(spec, self.flat_weights, x, hx, training=self.training, backend=self.backend,
                      layout=self.layout, batch_first=False)
        parts = hy if spec.mode == "lstm" else (hy,)
        out = tuple(p[0, 0] if unbatched else p[0] for p in parts)
        return out if spec.mode == "lstm" else out[0]


class LSTMCell(_Cell):
    """One LSTM step, a drop-in for :class:`torch.nn.LSTMCell`, with LSTM's options.

    Options: proj_size, peephole, coupled_gates, cell_clip, proj_clip, layer_norm, zoneout
    (a probability, or a pair for h and c), bias_mode, forget_bias. Variational dropout and
    DropConnect are per-sequence options and belong to :class:`LSTM`.

    ``forward(input (B, I), (h (B, Hr), c (B, H)) or None) -> (h', c')``.

    Example (generation with the carried state):
        >>> cell = rnnkit.LSTMCell(10, 20, peephole=True)
        >>> h, c = cell(torch.randn(3, 10))
        >>> h, c = cell(torch.randn(3, 10), (h, c))
    """

    def __init__(self, input_size, hidden_size, bias=True, **options):
        super().__init__("lstm", input_size, hidden_size, bias, **options)

    def forward(self, input, hx=None):
        return self._step(input, hx)


class GRUCell(_Cell):
    """One GRU step, a drop-in for :class:`torch.nn.GRUCell`; options reset_after, layer_norm, zoneout, bias_mode.

    ``forward(input (B, I), h (B, H) or None) -> h'``.
    """

    def __init__(self, input_size, hidden_size, bias=True, **options):
        super().__init__("gru", input_size, hidden_size, bias, **options)

    def forward(self, input, hx=None):
        return self._step(input, hx)


class RNNCell(_Cell):
    """One Elman RNN step, a drop-in for :class:`torch.nn.RNNCell`; options layer_norm, zoneout, bias_mode.

    ``forward(input (B, I), h (B, H) or None) -> h'``.
    """

    def __init__(self, input_size, hidden_size, bias=True, nonlinearity="tanh", **options):
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"nonlinearity: expected 'tanh' or 'relu', got {nonlinearity!r}")
        super().__init__(f"rnn_{nonlinearity}", input_size, hidden_size, bias, **options)
        self.nonlinearity = nonlinearity

    def forward(self, input, hx=None):
        return self._step(input, hx)
