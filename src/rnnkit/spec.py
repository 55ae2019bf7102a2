"""The descriptor of a recurrent stack (the analogue of ``cudnnRNNDescriptor_t``).

An `RNNSpec` is validated once, at construction, and is immutable afterwards.
Everything downstream (the packed buffer layout, the backends, the converters) reads
sizes and options from it and never re-validates them. The equations every option
refers to are in docs/spec.md.
"""
from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Callable, FrozenSet, List, Optional, Sequence, Tuple, Union

import numpy as np

MODES = ("rnn_tanh", "rnn_relu", "lstm", "gru")
BIAS_MODES = ("double", "single_input", "single_recurrent", "none")
MERGES = ("concat", "sum")
GATES = {"rnn_tanh": 1, "rnn_relu": 1, "lstm": 4, "gru": 3}


FORMATS = ("cudnn", "onnx", "keras", "flax", "tf", "mxnet", "haste")  # rnnkit.interop's modules


@dataclass(frozen=True)
class Option:
    """One option of `RNNSpec`: which cell families take it, which backends compute it, and
    which foreign formats (rnnkit.interop) carry it.

    ``in_use(spec)`` says whether a spec uses the option in a way that matters (``reset_after`` has
    two rows, one for each value, since formats differ in which they compute); ``label`` is how
    messages name that use (``"reset_after=False"``). ``changes_inference`` is False for the
    training-only options (the dropouts), which converters do not export. Adding an option means:
    its math in the reference and the kernels, and one row here; the backends' "can I run this?"
    checks and the converters' refusals read this table.
    """

    label: str
    families: Tuple[str, ...]
    in_use: Callable[["RNNSpec"], bool]
    native: bool = False  # torch's own RNN ops (oneDNN / cuDNN) compute it (native.py may still decline: proj_size on the CPU)
    formats: FrozenSet[str] = frozenset()  # the interop formats that carry it
    changes_inference: bool = True

    @property
    def name(self) -> str:
        """The RNNSpec keyword the option belongs to."""
        return self.label.split("=")[0].split(">")[0].replace("per-layer sizes", "hidden_size")


ALL_FAMILIES = ("lstm", "gru", "rnn")
_ALL = frozenset(FORMATS)


def _sizes_differ(s: "RNNSpec") -> bool:
    return len(set(s.hidden_sizes)) > 1 or len(set(s.proj_sizes)) > 1


OPTIONS: Tuple[Option, ...] = (
    Option("proj_size", ("lstm",), lambda s: any(s.proj_sizes), native=True, formats=frozenset({"cudnn", "mxnet", "tf"})),
    Option("proj_clip", ("lstm",), lambda s: s.proj_clip is not None, formats=frozenset({"tf"})),
    Option("cell_clip", ("lstm",), lambda s: s.cell_clip is not None, formats=frozenset({"cudnn", "mxnet", "tf"})),
    Option("peephole", ("lstm",), lambda s: s.peephole, formats=frozenset({"onnx", "tf"})),
    Option("coupled_gates", ("lstm",), lambda s: s.coupled_gates, formats=frozenset({"onnx"})),
    Option("reset_after=False", ("gru",), lambda s: not s.reset_after, formats=frozenset({"keras", "onnx", "tf"})),
    Option("reset_after=True", ("gru",), lambda s: s.mode == "gru" and s.reset_after, native=True,
           formats=_ALL - {"tf"}),
    Option("layer_norm", ALL_FAMILIES, lambda s: s.layer_norm, formats=frozenset({"haste"})),
    Option("zoneout", ALL_FAMILIES, lambda s: any(s.zoneout), formats=frozenset({"haste"})),
    Option("bias_mode", ALL_FAMILIES, lambda s: s.bias_mode not in ("double", "none"), formats=_ALL),
    Option("merge='sum'", ALL_FAMILIES, lambda s: s.bidirectional and s.merge == "sum",
           formats=frozenset({"flax", "keras", "onnx"})),
    Option("per-layer sizes", ALL_FAMILIES, _sizes_differ, formats=frozenset({"flax", "haste", "keras", "onnx", "tf"})),
    Option("bidirectional", ALL_FAMILIES, lambda s: s.bidirectional, native=True, formats=_ALL - {"haste"}),
    Option("num_layers>1", ALL_FAMILIES, lambda s: s.num_layers > 1, native=True, formats=_ALL),
    Option("nonlinearity='relu'", ("rnn",), lambda s: s.mode == "rnn_relu", native=True,
           formats=frozenset({"cudnn", "flax", "keras", "mxnet", "onnx"})),
    Option("dropout", ALL_FAMILIES, lambda s: s.dropout > 0, native=True, changes_inference=False),
    Option("input_dropout", ALL_FAMILIES, lambda s: s.input_dropout > 0, changes_inference=False),
    Option("recurrent_dropout", ALL_FAMILIES, lambda s: s.recurrent_dropout > 0, changes_inference=False),
    Option("dropconnect", ALL_FAMILIES, lambda s: s.dropconnect > 0, changes_inference=False),
)


def family(mode: str) -> str:
    """The cell family of a mode: "lstm", "gru" or "rnn" (rnn_tanh and rnn_relu)."""
    return "rnn" if mode.startswith("rnn") else mode


def options_in_use(spec: "RNNSpec", *, native: Optional[bool] = None, inference_only: bool = False) -> List[str]:
    """The labels of the options ``spec`` uses, from `OPTIONS`; ``native=False`` keeps only
    those torch's own RNN ops do not compute, ``inference_only`` drops the training-only ones."""
    used = [OPTIONS[k] for k in spec._in_use]
    return [o.label for o in used if (native is None or o.native == native) and (o.changes_inference or not inference_only)]


def not_carried_by(fmt: str, spec: "RNNSpec") -> List[str]:
    """The labels of the options ``spec`` uses in evaluation that the format ``fmt`` cannot carry."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt: expected one of {FORMATS}, got {fmt!r}")
    return [OPTIONS[k].label for k in spec._in_use if OPTIONS[k].changes_inference and fmt not in OPTIONS[k].formats]


@dataclass(frozen=True)
class CellSpec:
    """One layer's cell: what a backend needs to run one layer in one direction."""

    mode: str
    input_size: int
    hidden_size: int
    proj_size: int = 0
    peephole: bool = False
    coupled_gates: bool = False
    reset_after: bool = True
    layer_norm: bool = False
    bias_mode: str = "double"
    cell_clip: Optional[float] = None
    proj_clip: Optional[float] = None
    zoneout_h: float = 0.0
    zoneout_c: float = 0.0

    def __post_init__(self):
        """The values RNNSpec would take for one layer (a CellSpec built by hand is checked too)."""
        if self.mode not in MODES:
            raise _fail("mode", f"one of {MODES}", self.mode)
        _positive_int("input_size", self.input_size)
        _positive_int("hidden_size", self.hidden_size)
        if isinstance(self.proj_size, bool) or not isinstance(self.proj_size, numbers.Integral):
            raise TypeError(f"proj_size: expected an int, got {type(self.proj_size).__name__} {self.proj_size!r}")
        if not 0 <= self.proj_size < self.hidden_size:
            raise _fail("proj_size", f"0 (none) or a size smaller than hidden_size ({self.hidden_size})", self.proj_size)
        for name in ("peephole", "coupled_gates", "reset_after", "layer_norm"):
            _flag(name, getattr(self, name))
        if self.bias_mode not in BIAS_MODES:
            raise _fail("bias_mode", f"one of {BIAS_MODES}", self.bias_mode)
        _clip("cell_clip", self.cell_clip)
        _clip("proj_clip", self.proj_clip)
        _probability("zoneout_h", self.zoneout_h)
        _probability("zoneout_c", self.zoneout_c)
        # the combinations RNNSpec._check_combinations refuses, for one layer
        if self.mode != "lstm":
            for name, used in (("proj_size", self.proj_size > 0), ("proj_clip", self.proj_clip is not None),
                               ("cell_clip", self.cell_clip is not None), ("peephole", self.peephole),
                               ("coupled_gates", self.coupled_gates), ("zoneout_c", self.zoneout_c > 0)):
                if used:
                    raise ValueError(f"{name}: only LSTM has this option, got mode={self.mode!r}")
        if not self.reset_after and self.mode != "gru":
            raise ValueError(f"reset_after: only GRU has this option (False), got mode={self.mode!r}")
        if self.layer_norm and self.mode == "gru" and not self.reset_after:
            raise ValueError("layer_norm: has no reference definition for GRU with reset_after=False "
                             "(docs/spec.md, Layer normalization); use reset_after=True")
        if self.proj_clip is not None and not self.proj_size:
            raise ValueError("proj_clip: needs a projection (proj_size > 0), got proj_size=0")

    @property
    def gates(self) -> int:
        """Number of gate blocks G in W and R (a coupled LSTM has 3: i, g, o)."""
        return 3 if (self.mode == "lstm" and self.coupled_gates) else GATES[self.mode]

    @property
    def output_size(self) -> int:
        """Hr: the size of h (the projection size when projecting, else hidden_size)."""
        return self.proj_size or self.hidden_size

    @property
    def has_bias_ih(self) -> bool:
        return self.bias_mode in ("double", "single_input")

    @property
    def has_bias_hh(self) -> bool:
        return self.bias_mode in ("double", "single_recurrent")

    @property
    def peephole_rows(self) -> int:
        """Peephole rows: i, f, o (3) or, with coupled gates, i, o (2)."""
        return 2 if self.coupled_gates else 3


def _fail(argument: str, expected: str, got) -> ValueError:
    return ValueError(f"{argument}: expected {expected}, got {got!r}")


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected a positive int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise _fail(name, "a positive int", value)
    return int(value)


def _probability(name: str, value, one: bool = False) -> float:
    """A probability in [0, 1), or [0, 1] with ``one`` (a dropout: p = 1 drops everything, as
    torch.nn's ``dropout=1`` does; a zoneout of 1 would freeze the state, so it is refused)."""
    interval = "[0, 1]" if one else "[0, 1)"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a probability in {interval}, got {type(value).__name__} {value!r}")
    if not (0.0 <= float(value) <= 1.0 if one else 0.0 <= float(value) < 1.0):
        raise _fail(name, f"a probability in {interval}", value)
    return float(value)


def _flag(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):  # numpy's bool too, as torch.nn takes it
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def _clip(name: str, value) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected None or a positive finite float, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise _fail(name, "None or a positive finite float", value)
    return float(value)


def _per_layer(name: str, value, num_layers: int, check) -> Tuple[Tuple[int, ...], bool]:
    """An int, or a list/tuple with one entry per layer -> (per-layer tuple, given_as_list)."""
    if isinstance(value, (list, tuple)):
        if len(value) != num_layers:
            raise ValueError(
                f"{name}: expected one entry per layer ({num_layers} for num_layers={num_layers}), "
                f"got {len(value)} entries {list(value)!r}"
            )
        return tuple(check(f"{name}[{k}]", v) for k, v in enumerate(value)), True
    return (check(name, value),) * num_layers, False


def _non_negative_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected a non-negative int, got {type(value).__name__} {value!r}")
    if value < 0:
        raise _fail(name, "a non-negative int", value)
    return int(value)


# RNNSpec's constructor keywords that it keeps as fields of the same name and value
_KEPT_AS_GIVEN = ("num_layers", "bidirectional", "merge", "proj_clip", "cell_clip", "peephole", "coupled_gates",
                  "reset_after", "layer_norm", "bias_mode", "dropout", "input_dropout", "recurrent_dropout",
                  "dropconnect", "batch_first")


@dataclass(frozen=True, init=False)
class RNNSpec:
    """Validated description of a recurrent stack: cell kind, sizes and options.

    Args:
        mode: ``"rnn_tanh"``, ``"rnn_relu"``, ``"lstm"`` or ``"gru"``.
        input_size: I, the feature size of the input.
        hidden_size: H, an int or a list with one entry per layer.
        num_layers: L, the number of stacked layers.
        bidirectional: run a reverse direction too (D = 2).
        merge: how the two directions' outputs combine: ``"concat"`` (cuDNN) or ``"sum"`` (oneDNN).
        proj_size: LSTM projection size P (0 = none), an int or a per-layer list; P < H.
        proj_clip: clamp the projected h to ±proj_clip (needs a projection).
        cell_clip: clamp c to ±cell_clip (LSTM).
        peephole: diagonal peephole connections (LSTM).
        coupled_gates: f := 1 - i, no forget-gate parameters (LSTM; Greff's CIFG).
        reset_after: GRU reset convention; True applies r after R·h (cuDNN, PyTorch).
        layer_norm: layer-normalize the input and recurrent pre-activations (and c on LSTM).
        bias_mode: ``"double"``, ``"single_input"``, ``"single_recurrent"`` or ``"none"``.
        dropout: dropout on every layer's output but the last (training only).
        input_dropout: variational dropout on each layer's input (one mask per sequence).
        recurrent_dropout: variational dropout on the h that enters R (one mask per sequence).
        dropconnect: DropConnect on R (one mask per forward call, training only).
        zoneout: a probability for h, or on LSTM a pair ``(p_h, p_c)``.
        batch_first: inputs and outputs are (B, T, ·) instead of (T, B, ·).

    Example:
        >>> spec = RNNSpec("lstm", input_size=8, hidden_size=16, num_layers=2, peephole=True)
        >>> spec.cell(1).input_size
        16
    """

    mode: str
    input_size: int
    hidden_sizes: Tuple[int, ...]
    proj_sizes: Tuple[int, ...]
    num_layers: int
    bidirectional: bool
    merge: str
    proj_clip: Optional[float]
    cell_clip: Optional[float]
    peephole: bool
    coupled_gates: bool
    reset_after: bool
    layer_norm: bool
    bias_mode: str
    dropout: float
    input_dropout: float
    recurrent_dropout: float
    dropconnect: float
    zoneout: Tuple[float, float]
    batch_first: bool
    per_layer: bool

    def __init__(
        self,
        mode: str,
        input_size: int,
        hidden_size: Union[int, Sequence[int]],
        num_layers: int = 1,
        *,
        bidirectional: bool = False,
        merge: str = "concat",
        proj_size: Union[int, Sequence[int]] = 0,
        proj_clip: Optional[float] = None,
        cell_clip: Optional[float] = None,
        peephole: bool = False,
        coupled_gates: bool = False,
        reset_after: bool = True,
        layer_norm: bool = False,
        bias_mode: str = "double",
        dropout: float = 0.0,
        input_dropout: float = 0.0,
        recurrent_dropout: float = 0.0,
        dropconnect: float = 0.0,
        zoneout: Union[float, Tuple[float, float]] = 0.0,
        batch_first: bool = False,
    ):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        if mode not in MODES:
            raise _fail("mode", f"one of {MODES}", mode)
        set_("mode", mode)
        set_("input_size", _positive_int("input_size", input_size))
        num_layers = _positive_int("num_layers", num_layers)
        set_("num_layers", num_layers)
        hidden_sizes, hidden_listed = _per_layer("hidden_size", hidden_size, num_layers, _positive_int)
        proj_sizes, proj_listed = _per_layer("proj_size", proj_size, num_layers, _non_negative_int)
        set_("hidden_sizes", hidden_sizes)
        set_("proj_sizes", proj_sizes)
        set_("per_layer", hidden_listed or proj_listed)
        set_("bidirectional", _flag("bidirectional", bidirectional))
        if merge not in MERGES:
            raise _fail("merge", f"one of {MERGES}", merge)
        set_("merge", merge)
        for name in ("peephole", "coupled_gates", "reset_after", "layer_norm", "batch_first"):
            set_(name, _flag(name, locals()[name]))
        if bias_mode not in BIAS_MODES:
            raise _fail("bias_mode", f"one of {BIAS_MODES}", bias_mode)
        set_("bias_mode", bias_mode)
        for name in ("dropout", "input_dropout", "recurrent_dropout", "dropconnect"):
            set_(name, _probability(name, locals()[name], one=True))
        set_("proj_clip", _clip("proj_clip", proj_clip))
        set_("cell_clip", _clip("cell_clip", cell_clip))
        set_("zoneout", self._zoneout(zoneout))
        self._check_combinations()
        # not fields (no part of ==, hash): what every call would otherwise recompute
        set_("_cells", tuple(self._make_cell(k) for k in range(num_layers)))
        set_("_in_use", tuple(k for k, o in enumerate(OPTIONS) if o.in_use(self)))  # indices: picklable
        if self.dropout > 0 and num_layers == 1:
            warnings.warn(
                "dropout > 0 acts only between layers, so with num_layers=1 it does nothing "
                f"(dropout={self.dropout}, num_layers=1)",
                stacklevel=3,
            )

    def _zoneout(self, zoneout) -> Tuple[float, float]:
        if isinstance(zoneout, (tuple, list)):
            if self.mode != "lstm":
                raise ValueError(f"zoneout: a (p_h, p_c) pair needs mode='lstm', got mode={self.mode!r}")
            if len(zoneout) != 2:
                raise _fail("zoneout", "a probability or a pair (p_h, p_c)", zoneout)
            return (_probability("zoneout[0]", zoneout[0]), _probability("zoneout[1]", zoneout[1]))
        return (_probability("zoneout", zoneout), 0.0)

    def _check_combinations(self) -> None:
        for option in OPTIONS:
            if option.in_use(self) and family(self.mode) not in option.families:
                taking = " and ".join(f.upper() for f in option.families)
                raise ValueError(f"{option.name}: only {taking} has this option, got mode={self.mode!r}")
        if self.layer_norm and self.mode == "gru" and not self.reset_after:
            raise ValueError(
                "layer_norm: has no reference definition for GRU with reset_after=False "
                "(docs/spec.md, Layer normalization); use reset_after=True"
            )
        for k, (hidden, proj) in enumerate(zip(self.hidden_sizes, self.proj_sizes)):
            if proj and proj >= hidden:
                name = f"proj_size[{k}]" if self.per_layer else "proj_size"
                raise ValueError(f"{name}: expected a size smaller than hidden_size ({hidden}), got {proj}")
        if self.proj_clip is not None and not any(self.proj_sizes):
            raise ValueError("proj_clip: needs a projection (proj_size > 0), got proj_size=0")
        if self.merge != "concat" and not self.bidirectional:
            raise ValueError(f"merge: {self.merge!r} merges the two directions' outputs, so it needs "
                             "bidirectional=True, got bidirectional=False")

    # ---- derived sizes -------------------------------------------------------------

    @property
    def num_directions(self) -> int:
        return 2 if self.bidirectional else 1

    @property
    def gates(self) -> int:
        return self.cell(0).gates

    def output_size(self, layer: int) -> int:
        """Hr of one layer (the size of its h in each direction)."""
        return self.proj_sizes[layer] or self.hidden_sizes[layer]

    def merged_size(self, layer: int) -> int:
        """Feature size of one layer's output sequence, after merging directions."""
        concat = self.bidirectional and self.merge == "concat"
        return self.output_size(layer) * (2 if concat else 1)

    def layer_input_size(self, layer: int) -> int:
        return self.input_size if layer == 0 else self.merged_size(layer - 1)

    @property
    def output_feature_size(self) -> int:
        """Feature size of the stack's output y."""
        return self.merged_size(self.num_layers - 1)

    def cell(self, layer: int) -> CellSpec:
        """The cell of one layer (both directions share it)."""
        return self._cells[layer]

    def _make_cell(self, layer: int) -> CellSpec:
        return CellSpec(
            mode=self.mode,
            input_size=self.layer_input_size(layer),
            hidden_size=self.hidden_sizes[layer],
            proj_size=self.proj_sizes[layer],
            peephole=self.peephole,
            coupled_gates=self.coupled_gates,
            reset_after=self.reset_after,
            layer_norm=self.layer_norm,
            bias_mode=self.bias_mode,
            cell_clip=self.cell_clip,
            proj_clip=self.proj_clip if self.proj_sizes[layer] else None,
            zoneout_h=self.zoneout[0],
            zoneout_c=self.zoneout[1],
        )

    @property
    def random_options(self) -> tuple:
        """The options that draw random masks in training, by name: the dropouts (``dropout``
        only between layers), DropConnect, zoneout."""
        named = (("dropout", self.dropout and self.num_layers > 1), ("input_dropout", self.input_dropout),
                 ("recurrent_dropout", self.recurrent_dropout), ("dropconnect", self.dropconnect),
                 ("zoneout", any(self.zoneout)))
        return tuple(name for name, on in named if on)

    @property
    def uses_dropout_masks(self) -> bool:
        """Whether training draws random masks (`random_options`)."""
        return bool(self.random_options)

    def __setstate__(self, state: dict) -> None:
        """Rebuilt by the constructor from the options it kept (a pickle's, a deepcopy's), so a spec
        pickled by an older rnnkit, with fewer options and derived fields, gets this one's; an
        option it did not have takes its default."""
        hidden, proj = tuple(state["hidden_sizes"]), tuple(state.get("proj_sizes", (0,) * len(state["hidden_sizes"])))
        listed = state.get("per_layer", len(set(hidden)) > 1 or len(set(proj)) > 1)
        zoneout = state.get("zoneout", 0.0)
        if isinstance(zoneout, (tuple, list)):
            zoneout = list(zoneout) if zoneout[1] else zoneout[0]
        kept = {name: state[name] for name in _KEPT_AS_GIVEN if name in state}
        self.__init__(state["mode"], state["input_size"], list(hidden) if listed else hidden[0],
                      proj_size=list(proj) if listed else proj[0], zoneout=zoneout, **kept)

    def options(self) -> dict:
        """The keyword arguments that rebuild this spec: ``RNNSpec(**spec.options())``."""
        listed = self.per_layer
        return dict(
            mode=self.mode,
            input_size=self.input_size,
            hidden_size=list(self.hidden_sizes) if listed else self.hidden_sizes[0],
            num_layers=self.num_layers,
            bidirectional=self.bidirectional,
            merge=self.merge,
            proj_size=list(self.proj_sizes) if listed else self.proj_sizes[0],
            proj_clip=self.proj_clip,
            cell_clip=self.cell_clip,
            peephole=self.peephole,
            coupled_gates=self.coupled_gates,
            reset_after=self.reset_after,
            layer_norm=self.layer_norm,
            bias_mode=self.bias_mode,
            dropout=self.dropout,
            input_dropout=self.input_dropout,
            recurrent_dropout=self.recurrent_dropout,
            dropconnect=self.dropconnect,
            zoneout=list(self.zoneout) if self.zoneout[1] else self.zoneout[0],
            batch_first=self.batch_first,
        )
