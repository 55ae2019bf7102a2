"""The packed parameter buffer: its layout, its named views, and its initialization.

Layout (docs/spec.md, "Parameters: one packed buffer"): all parameters of a stack live in one
contiguous 1-D tensor. For each layer, for each direction (forward first), the pieces
follow torch.nn / cuDNN order, then this layer-direction's extras::

    weight_ih   (G·H, I_k)      gates stacked in docs/spec.md's order (LSTM i f g o, GRU r z n)
    weight_hh   (G·H, Hr)
    bias_ih     (G·H,)          bias_mode "double" or "single_input"
    bias_hh     (G·H,)          bias_mode "double" or "single_recurrent"
    weight_hr   (P, H)          LSTM with projection
    weight_peephole             (3, H) rows i, f, o; (2, H) rows i, o with coupled gates
    layer_norm_ih_weight/bias   (G·H,) each
    layer_norm_hh_weight/bias   (G·H,) each
    layer_norm_c_weight/bias    (H,) each, LSTM

Views are named like torch.nn's parameters, with ``_l{k}`` and ``_reverse`` suffixes on a
stack (``weight_hh_l1_reverse``) and no suffix on a cell (``weight_ih``), so torch.nn
state_dicts load as they are. Views are cut from the buffer on demand, so they are
always views of the current buffer (after ``.to()``, ``load_state_dict``, deepcopy, ...).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Dict, Iterator, List, Mapping, NamedTuple, Optional, Tuple

import torch

from .errors import MismatchError
from .spec import CellSpec, RNNSpec


@dataclass(frozen=True)
class ParamEntry:
    name: str  # the state_dict key, e.g. "weight_hh_l1_reverse"
    piece: str  # the piece without suffixes, e.g. "weight_hh"
    layer: int
    direction: int
    shape: Tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


# The weights of one pass by role (the kernels' argument names), and the packed buffer's piece
# each one is: also the order of the pieces in the buffer and of a pass's gradient block.
WEIGHT_SLOTS = (
    ("W", "weight_ih"), ("R", "weight_hh"), ("b_W", "bias_ih"), ("b_R", "bias_hh"), ("W_hr", "weight_hr"),
    ("peephole", "weight_peephole"),
    ("ln_x_gain", "layer_norm_ih_weight"), ("ln_x_shift", "layer_norm_ih_bias"),
    ("ln_h_gain", "layer_norm_hh_weight"), ("ln_h_shift", "layer_norm_hh_bias"),
    ("ln_c_gain", "layer_norm_c_weight"), ("ln_c_shift", "layer_norm_c_bias"),
)
SLOT_OF_PIECE = {piece: slot for slot, piece in WEIGHT_SLOTS}


class PassWeights(NamedTuple):
    """The weights of one layer in one direction; absent pieces are None.

    ``ln_x``, ``ln_h``, ``ln_c`` give each layer norm's (gain, shift) pair, or None.
    """

    W: torch.Tensor  # [G·H, I]
    R: torch.Tensor  # [G·H, Hr]
    b_W: Optional[torch.Tensor] = None  # [G·H]
    b_R: Optional[torch.Tensor] = None  # [G·H]
    W_hr: Optional[torch.Tensor] = None  # [P, H]
    peephole: Optional[torch.Tensor] = None  # [3 or 2, H]
    ln_x_gain: Optional[torch.Tensor] = None  # [G·H]
    ln_x_shift: Optional[torch.Tensor] = None
    ln_h_gain: Optional[torch.Tensor] = None  # [G·H]
    ln_h_shift: Optional[torch.Tensor] = None
    ln_c_gain: Optional[torch.Tensor] = None  # [H]
    ln_c_shift: Optional[torch.Tensor] = None

    @property
    def ln_x(self) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        return None if self.ln_x_gain is None else (self.ln_x_gain, self.ln_x_shift)

    @property
    def ln_h(self) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        return None if self.ln_h_gain is None else (self.ln_h_gain, self.ln_h_shift)

    @property
    def ln_c(self) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        return None if self.ln_c_gain is None else (self.ln_c_gain, self.ln_c_shift)

    def present(self) -> List[torch.Tensor]:
        """The weights that exist, in buffer order."""
        return [t for t in self if t is not None]


def cell_pieces(cell: CellSpec) -> List[Tuple[str, Tuple[int, ...]]]:
    """(piece, shape) of one layer-direction, in buffer order. The one place the order lives."""
    gh, hidden = cell.gates * cell.hidden_size, cell.hidden_size
    pieces = [("weight_ih", (gh, cell.input_size)), ("weight_hh", (gh, cell.output_size))]
    if cell.has_bias_ih:
        pieces.append(("bias_ih", (gh,)))
    if cell.has_bias_hh:
        pieces.append(("bias_hh", (gh,)))
    if cell.proj_size:
        pieces.append(("weight_hr", (cell.proj_size, hidden)))
    if cell.peephole:
        pieces.append(("weight_peephole", (cell.peephole_rows, hidden)))
    if cell.layer_norm:
        for which in ("ih", "hh"):
            pieces += [(f"layer_norm_{which}_weight", (gh,)), (f"layer_norm_{which}_bias", (gh,))]
        if cell.mode == "lstm":
            pieces += [("layer_norm_c_weight", (hidden,)), ("layer_norm_c_bias", (hidden,))]
    return pieces


TORCH_PIECES = ("weight_ih", "weight_hh", "bias_ih", "bias_hh", "weight_hr")


def check_spec(spec) -> RNNSpec:
    """An `RNNSpec`, or a TypeError naming what came instead (a mode string, a CellSpec, ...)."""
    if not isinstance(spec, RNNSpec):
        raise TypeError(f"spec: expected an rnnkit.RNNSpec, got {type(spec).__name__}")
    return spec


class Layout:
    """Where every parameter of a stack (or a cell) lives in the packed buffer.

    Args:
        spec: the stack's descriptor.
        suffixes: name views ``weight_ih_l0`` (a stack) or ``weight_ih`` (a cell; needs
            a single layer and direction).
    """

    def __init__(self, spec: RNNSpec, suffixes: bool = True):
        check_spec(spec)
        if not suffixes and (spec.num_layers != 1 or spec.bidirectional):
            raise ValueError("Layout: suffix-free names need one layer and one direction")
        self.spec = spec
        self.suffixes = suffixes
        self.entries: List[ParamEntry] = []
        offset = 0
        for layer in range(spec.num_layers):
            for direction in range(spec.num_directions):
                for piece, shape in cell_pieces(spec.cell(layer)):
                    name = piece
                    if suffixes:
                        name += f"_l{layer}" + ("_reverse" if direction else "")
                    self.entries.append(ParamEntry(name, piece, layer, direction, shape, offset))
                    offset += math.prod(shape)
        self.numel = offset
        self.index: Dict[str, ParamEntry] = {e.name: e for e in self.entries}
        # per pass (layer by layer, forward first): (slot, entry name) of each of its pieces
        D = spec.num_directions
        self._pass_slots = [[] for _ in range(spec.num_layers * D)]
        for e in self.entries:
            self._pass_slots[e.layer * D + e.direction].append((SLOT_OF_PIECE[e.piece], e.name))

    def __setstate__(self, state) -> None:
        """Rebuilt from its spec, so a Layout pickled by an older rnnkit gets what this one derives
        (before 2026-11-25 it kept no ``suffixes``: its entries' names tell, a stack's ending in
        ``_l{k}`` or ``_l{k}_reverse``)."""
        suffixes = state.get("suffixes")
        if suffixes is None:
            suffixes = any(e.name != e.piece for e in state["entries"])
        self.__init__(state["spec"], suffixes=suffixes)

    def __iter__(self) -> Iterator[ParamEntry]:
        return iter(self.entries)

    def view(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        """The piece ``name`` (an entry's name, e.g. ``"weight_hh_l0"``) as a view of ``flat``."""
        self._check_buffer(flat)
        entry = self.index.get(name)
        if entry is None:
            names = list(self.index)
            shown = ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")
            raise ValueError(f"name: expected one of this layout's names ({shown}), got {name!r}")
        return flat[entry.offset : entry.offset + entry.numel].view(entry.shape)

    def _check_buffer(self, flat) -> None:
        """A 1-D tensor of ``numel`` values, or an error naming ``flat``."""
        if not isinstance(flat, torch.Tensor):
            raise TypeError(f"flat: expected the packed 1-D parameter tensor, got {type(flat).__name__}")
        if flat.dim() != 1 or flat.numel() != self.numel:
            raise MismatchError(f"flat: expected a 1-D tensor of {self.numel} values (this layout's numel), "
                                f"got shape {tuple(flat.shape)}")

    def named_views(self, flat: torch.Tensor) -> Dict[str, torch.Tensor]:
        """{name: view of ``flat``} for every entry, in buffer order."""
        self._check_buffer(flat)
        return {e.name: flat[e.offset : e.offset + e.numel].view(e.shape) for e in self.entries}

    def pieces(self, flat: torch.Tensor, layer: int, direction: int) -> Dict[str, torch.Tensor]:
        """{piece: view of ``flat``} of one layer-direction (``"weight_hh": ...``)."""
        self._check_buffer(flat)
        for name, value, count in (("layer", layer, self.spec.num_layers),
                                   ("direction", direction, self.spec.num_directions)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value < count:
                raise ValueError(f"{name}: expected an int in [0, {count}) for this layout, got {value!r}")
        return {
            e.piece: flat[e.offset : e.offset + e.numel].view(e.shape)
            for e in self.entries
            if e.layer == layer and e.direction == direction
        }

    def pass_weights(self, flat: torch.Tensor, layer: int, direction: int) -> PassWeights:
        """One pass's weights as views of a packed buffer."""
        return PassWeights(**{SLOT_OF_PIECE[piece]: view for piece, view in self.pieces(flat, layer, direction).items()})

    def all_pass_weights(self, flat: torch.Tensor) -> List[PassWeights]:
        """Every pass's weights as views of a packed buffer, layer by layer, forward direction first."""
        return self.group(self.named_views(flat))

    def group(self, tensors: Dict[str, torch.Tensor]) -> List[PassWeights]:
        """{name: tensor} for every entry -> one PassWeights per pass, layer by layer, forward first."""
        try:
            return [PassWeights(**{slot: tensors[name] for slot, name in slots}) for slots in self._pass_slots]
        except (KeyError, TypeError):
            if not isinstance(tensors, Mapping):
                raise TypeError(f"tensors: expected a mapping {{entry name: tensor}}, got {type(tensors).__name__}") from None
            missing = [e.name for e in self.entries if e.name not in tensors]
            raise ValueError(f"tensors: expected a tensor for every entry of this layout, missing {missing}") from None

    def pass_names(self) -> List[Dict[str, str]]:
        """One {slot: entry name} per pass, layer by layer, forward first (``{"W": "weight_ih_l0", ...}``)."""
        return [dict(slots) for slots in self._pass_slots]

    def new_buffer(self, device=None, dtype=None, forget_bias: Optional[float] = None) -> torch.Tensor:
        """A freshly initialized packed buffer (see `initialize`)."""
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"dtype: expected a floating-point dtype, got {dtype!r}")
        flat = torch.empty(self.numel, device=device, dtype=dtype or torch.get_default_dtype())
        initialize(self, flat, forget_bias=forget_bias)
        return flat


def check_forget_bias(spec: RNNSpec, forget_bias) -> Optional[float]:
    """``forget_bias`` as a float (or None), or an error naming it: it needs an LSTM with a forget
    gate and a bias, and a finite real number."""
    if forget_bias is None:
        return None
    if spec.mode != "lstm" or spec.coupled_gates:
        raise ValueError(
            f"forget_bias: needs an LSTM with a forget gate, got mode={spec.mode!r}, "
            f"coupled_gates={spec.coupled_gates}"
        )
    if spec.bias_mode == "none":
        raise ValueError("forget_bias: needs a bias, got bias_mode='none'")
    if not isinstance(forget_bias, numbers.Real) or isinstance(forget_bias, bool):
        raise TypeError(f"forget_bias: expected a real number (int or float) or None, got {type(forget_bias).__name__}")
    forget_bias = float(forget_bias)
    if not math.isfinite(forget_bias):
        raise ValueError(f"forget_bias: expected a finite number, got {forget_bias}")
    return forget_bias


@torch.no_grad()
def initialize(layout: Layout, flat: torch.Tensor, forget_bias: Optional[float] = None) -> None:
    """Initialize a packed buffer in place, as torch.nn does.

    Weights, biases and peepholes are uniform in ±1/sqrt(H) of their layer. The torch.nn
    pieces are drawn first and in torch.nn's parameter order, so under the same seed an
    rnnkit stack without extras starts from the same weights as its torch.nn twin.
    Layer-norm gains start at 1 and shifts at 0. ``forget_bias`` (LSTM without coupled
    gates) sets the forget-gate slice of the bias to that value (split between the biases
    of "double" mode as bias_ih = forget_bias, bias_hh = 0); a finite real number or None.
    """
    spec = layout.spec
    forget_bias = check_forget_bias(spec, forget_bias)
    standard = [e for e in layout if e.piece in TORCH_PIECES]
    extras = [e for e in layout if e.piece not in TORCH_PIECES]
    for entry in standard + extras:
        view = layout.view(flat, entry.name)
        if entry.piece.startswith("layer_norm_"):
            view.fill_(1.0 if entry.piece.endswith("_weight") else 0.0)
        else:
            bound = 1.0 / math.sqrt(spec.hidden_sizes[entry.layer])
            view.uniform_(-bound, bound)
    if forget_bias is not None:
        for entry in layout:
            if entry.piece in ("bias_ih", "bias_hh"):
                hidden = spec.hidden_sizes[entry.layer]
                first = entry.piece == "bias_ih" or spec.bias_mode == "single_recurrent"
                layout.view(flat, entry.name)[hidden : 2 * hidden] = forget_bias if first else 0.0
