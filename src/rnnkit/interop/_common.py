"""What every converter shares: gate reordering, option checks, and building a module.

Gate orders (docs/spec.md, "Gate orders elsewhere") are written as strings of rnnkit's gate
letters, so one function maps any format onto any other:

    rnnkit LSTM "ifgo" (coupled: "igo"), GRU "rzn", RNN "h"

A format's order uses the same letters for the same gates: ONNX's LSTM "i o f c" is
"iofg" here, Keras's GRU "z r h" is "zrn". A letter missing from the source order is
filled with zeros (exporting a coupled LSTM into a 4-gate format); a letter missing from
the destination is dropped (importing it back).
"""
from __future__ import annotations

import math
import numbers
from typing import Dict, Iterable, Optional, Union

import numpy as np
import torch

from ..nn import GRU, LSTM, RNN
from ..spec import RNNSpec, not_carried_by

Module = Union[LSTM, GRU, RNN]

RNNKIT_GATES = {"lstm": "ifgo", "gru": "rzn", "rnn_tanh": "h", "rnn_relu": "h"}
COUPLED_GATES = "igo"


def rnnkit_gates(spec: RNNSpec) -> str:
    """rnnkit's gate letters for this spec, in buffer order."""
    return COUPLED_GATES if spec.mode == "lstm" and spec.coupled_gates else RNNKIT_GATES[spec.mode]


def regate(blocks, src: str, dst: str, axis: int = 0):
    """Reorder the gate blocks of ``blocks`` along ``axis`` from order ``src`` to ``dst``.

    ``blocks.shape[axis]`` is ``len(src) * H``. Gates of ``dst`` absent from ``src`` come out
    as zeros; gates of ``src`` absent from ``dst`` are dropped. Works on numpy arrays and
    torch tensors.
    """
    size = blocks.shape[axis] // len(src)
    if size * len(src) != blocks.shape[axis]:
        raise ValueError(f"regate: axis {axis} of shape {tuple(blocks.shape)} is not {len(src)} gate blocks")
    lib = torch if isinstance(blocks, torch.Tensor) else np
    parts = []
    for gate in dst:
        if gate in src:
            k = src.index(gate)
            index = [slice(None)] * blocks.ndim
            index[axis] = slice(k * size, (k + 1) * size)
            parts.append(blocks[tuple(index)])
        else:
            shape = list(blocks.shape)
            shape[axis] = size
            parts.append(lib.zeros(shape, dtype=blocks.dtype))
    return np.concatenate(parts, axis) if lib is np else torch.cat(parts, axis)


def refuse(key: str, fmt: str, spec: RNNSpec) -> None:
    """Raise a ValueError naming the first option of ``spec`` that the format cannot represent.

    ``key`` is the format's column in the option table (``rnnkit.spec.OPTIONS``), ``fmt`` its name
    in messages. Training-only options (dropout, input_dropout, recurrent_dropout, dropconnect) do
    not change the inference function and are not exported anywhere.
    """
    for option in not_carried_by(key, spec):
        raise ValueError(f"{option}: {fmt} cannot represent this option of the {spec.mode} module")


def refuse_mode(fmt: str, spec: RNNSpec, modes: Iterable[str]) -> None:
    modes = tuple(modes)
    if spec.mode not in modes:
        raise ValueError(f"mode: {fmt} has no {spec.mode!r} layer (supported: {modes})")


def spec_of(module) -> RNNSpec:
    spec = getattr(module, "spec", None)
    if not isinstance(spec, RNNSpec) or not hasattr(module, "flat_weights"):
        raise TypeError(f"module: expected an rnnkit LSTM, GRU or RNN, got {type(module).__name__}")
    if not hasattr(module, "num_layers"):
        raise TypeError(f"module: expected a stack (rnnkit.LSTM / GRU / RNN), got the cell {type(module).__name__}")
    return spec


def to_numpy(value, name: str = "value") -> np.ndarray:
    """A numpy array from what a foreign library hands over (numpy, torch, TF, MXNet, jax arrays).

    Never returns a view that aliases a torch tensor the caller may change later.
    """
    if value is None:
        raise TypeError(f"{name}: expected an array, got None")
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy().copy()
    if hasattr(value, "asnumpy"):  # MXNet NDArray
        return value.asnumpy()
    if hasattr(value, "numpy") and not isinstance(value, np.ndarray):  # TF eager tensors, variables
        return np.asarray(value.numpy())
    try:
        return np.asarray(value)
    except Exception as error:  # noqa: BLE001 - any conversion failure is a type error of the argument
        raise TypeError(f"{name}: expected an array, got {type(value).__name__}") from error


def torch_pieces(module) -> Dict[str, torch.Tensor]:
    """{torch.nn name: detached copy} of every piece of the module's weights, in buffer order.

    Reads through the views of ``module.flat_weights`` (docs/spec.md, "Parameters: one packed
    buffer"; at the module's `flat_offsets`, which on CUDA can be cuDNN's placement), the one
    place converters read weights from.
    """
    with torch.no_grad():
        views = _weight_views(module)
        return {entry.name: views[entry.name].detach().clone() for entry in module.layout}


def _weight_views(module) -> Dict[str, torch.Tensor]:
    """{name: view of ``module.flat_weights``} at the module's offsets (its layout's, where it has no others)."""
    if hasattr(module, "weight_views"):
        return module.weight_views()
    return module.layout.named_views(module.flat_weights)


def numpy_pieces(module) -> Dict[str, np.ndarray]:
    """{torch.nn name: numpy copy} of every piece of the module's weights, in buffer order."""
    return {name: tensor.cpu().numpy() for name, tensor in torch_pieces(module).items()}


def build_module(spec: RNNSpec, pieces: Dict[str, object], dtype: Optional[torch.dtype] = None,
                 sources: Optional[Dict[str, str]] = None, what: str = "") -> Module:
    """A new rnnkit module for ``spec`` whose pieces (by torch.nn name) are set from ``pieces``.

    Every piece of the layout must be given; shapes are checked. ``pieces`` is not modified.
    ``sources``: each piece's name in the converter's own arguments (``named['l0_h2h_weight']``),
    which a shape error names; ``what``: what the arrays should be (``a Gluon gru layer's``).
    """
    options = spec.options()
    mode = options.pop("mode")
    input_size, hidden_size, num_layers = options.pop("input_size"), options.pop("hidden_size"), options.pop("num_layers")
    bias_mode = options.pop("bias_mode")
    common = dict(bias=bias_mode != "none", bias_mode=bias_mode, dtype=dtype or torch.float32)
    if mode == "lstm":
        module = LSTM(input_size, hidden_size, num_layers, **common, **options)
    elif mode == "gru":
        module = GRU(input_size, hidden_size, num_layers, **common, **options)
    else:
        module = RNN(input_size, hidden_size, num_layers, nonlinearity=mode[4:], **common, **options)
    load_pieces(module, pieces, sources, what)
    return module


def check_keys(found: Iterable, expected: Iterable, what: str, optional: Iterable = (), kind: str = "keys") -> None:
    """Refuse ``found`` unless it holds every key of ``expected`` and nothing but those and
    ``optional``: a ValueError that starts with ``what`` and lists the expected keys, the missing
    and the unexpected ones. Every converter checks what it is handed with this."""
    found, expected, optional = list(found), list(expected), list(optional)
    missing = [key for key in expected if key not in found]
    unexpected = sorted((key for key in found if key not in expected and key not in optional), key=repr)
    if missing or unexpected:
        wrong = "; ".join(f"{name} {keys}" for name, keys in (("missing", missing), ("unexpected", unexpected)) if keys)
        raise ValueError(f"{what}: expected the {kind} {expected}" + (f", optionally {optional}" if optional else "")
                         + f"; {wrong}")


def load_pieces(module, pieces: Dict[str, object], sources: Optional[Dict[str, str]] = None, what: str = "") -> None:
    """Copy ``pieces`` ({torch.nn name: array}) into the module's weights, checking names and shapes.

    The one place converters write weights: in-place copies into the views of
    ``module.flat_weights`` (`_weight_views`), without autograd.
    """
    entries = list(module.layout)
    check_keys(pieces, [entry.name for entry in entries], "weights", kind="pieces")
    values = {}
    for entry in entries:
        value = pieces[entry.name]
        where = (sources or {}).get(entry.name, f"weights: {entry.name}")
        if not isinstance(value, torch.Tensor):
            value = to_numpy(value, where)
        check_real(where, value.dtype)  # before torch's copy_, which drops an imaginary part with a warning only
        value = value.detach() if isinstance(value, torch.Tensor) else torch.from_numpy(value.copy())
        if tuple(value.shape) != tuple(entry.shape):
            raise ValueError(f"{where} expected shape {tuple(entry.shape)}{' (' + what + ')' if what else ''}, "
                             f"got {tuple(value.shape)}")
        values[entry.name] = value
    with torch.no_grad():
        views = _weight_views(module)
        for name, value in values.items():
            views[name].copy_(value.to(device=views[name].device, dtype=views[name].dtype))


def finite_number(name: str, value) -> float:
    """``value`` as a float: a real, finite number (not a bool, which Python counts as one), else a
    TypeError or ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, got {value!r}")
    return float(value)


def suffix(layer: int, direction: int) -> str:
    """The torch.nn name suffix of one layer-direction: ``_l1``, ``_l0_reverse``."""
    return f"_l{layer}" + ("_reverse" if direction else "")


def exported_pieces(module) -> Dict[str, np.ndarray]:
    """`numpy_pieces`, with a bfloat16 module's values as float32 arrays.

    numpy has no bfloat16 and every bfloat16 is a float32, so the values are exact; the
    format's own library casts them to its bfloat16 when its layer is built in that dtype.
    """
    return {name: (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).cpu().numpy()
            for name, tensor in torch_pieces(module).items()}


def imported_array(value, name: str = "value") -> np.ndarray:
    """`to_numpy` for importers: a bfloat16 array (a torch tensor, or ml_dtypes' bfloat16 that
    jax and ONNX hand over) comes back as float32, which holds it exactly and which torch reads.

    The module's dtype is the importer's ``dtype`` argument, so ``dtype=torch.bfloat16`` gives
    back the same bfloat16 values.
    """
    if isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16:
        value = value.float()
    array = to_numpy(value, name)
    if array.dtype.name == "bfloat16":
        array = array.astype(np.float32)
    check_real(f"{name}:", array.dtype)
    return array


def check_real(where: str, dtype) -> None:
    """A TypeError starting with ``where`` unless ``dtype`` (numpy's or torch's) holds real numbers:
    floats or integers (exact in a float module), not complex, bool or objects."""
    real = dtype.kind in "fiu" if isinstance(dtype, np.dtype) else not (dtype.is_complex or dtype == torch.bool)
    if not real:
        raise TypeError(f"{where} expected real numbers (a float or integer array), got dtype {dtype}")
