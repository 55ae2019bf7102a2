"""int8 dynamic quantization for inference: `quantize` and the quantized modules it makes.

What is quantized, for every cell family and option (peepholes, layer norm, projection and its
clip, per-layer sizes, bidirectional, lengths and PackedSequence, zoneout's expectation):

- the matrices W (``weight_ih``), R (``weight_hh``) and W_hr (``weight_hr``): int8 per output
  row, symmetric, ``w ≈ scale[row] · q``, q in [-127, 127], scale = max |row| / 127;
- the activations entering each of their GEMMs (x for W, h for R, m for W_hr): int8 per row (per
  batch row and step), symmetric, as they arrive; the products summed exactly in int32.

Biases, peepholes, layer norms, the pointwise math and the carried states (h, c) stay float32.
Inference only: a quantized module has buffers, not parameters, and computes evaluation mode's
function (no dropout; zoneout's expectation) whatever its ``training`` flag.

The kernels are the fused CPU passes (rnnkit/fused) with int8 weights: the custom op
``rnnkit::fused_int8_pass`` (compile- and export-clean). Its GEMM is exact integer arithmetic
(csrc/qgemm.cpp: VNNI's vpdpbusd where the CPU has it, else AVX2, else plain loops; see
`int8_kernel`), so every CPU computes the same values.

Example:
    >>> lstm = rnnkit.LSTM(64, 128, num_layers=2, peephole=True).eval()
    >>> q = rnnkit.quantize(lstm)                  # a new module; lstm is left as it was
    >>> y, (h, c) = q(torch.randn(20, 4, 64))
"""
from __future__ import annotations

import copy
from typing import NamedTuple, Optional

import torch
from torch import nn

from . import functional
from . import nn as float_nn
from .nn import (_NONLINEARITY, StepPlans, _Cell, _CellAttributes, _PackedModule, _Recurrent, _SpecAttributes,
                 _StackAttributes, check_cell_input, load_checked, memory_of, planned_call, pruning_hooks,
                 step_plans)
from .errors import DTypeMismatchError, MismatchError
from .params import Layout, PassWeights
from .passes import (PASS_ARGUMENTS, _direct, forward_ad_reason, mask_tensors, named, output_shapes, pass_scalars,
                     pass_values)

MATRICES = ("weight_ih", "weight_hh", "weight_hr")  # the pieces stored int8, each with a "_scale"


def quantize_rows(weight: torch.Tensor):
    """(q int8 [N, K], scale float32 [N]): ``weight ≈ scale[:, None] · q``, symmetric per row, q in
    [-127, 127] (round half to even); an all-zero row has scale 0. A row with a NaN or an infinity
    has no int8 form: its q is zero and its scale NaN, so every output it enters is NaN (as the
    activations' rows are treated: csrc/qgemm.cpp, quantize_rows)."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise TypeError(f"weight: expected a 2-D floating-point tensor, got {weight!r:.80}")
    w = weight.detach().to(torch.float32)
    amax = w.abs().amax(dim=1)  # NaN or inf where the row holds one (the reductions propagate NaN)
    finite = torch.isfinite(amax)
    # a row whose largest |w| is under ~3.7e-37 has no finite 127 / amax: it is scaled by 2^100 first
    # (exact: a power of two), every other row by 1 (the same products as without)
    boost = torch.where(amax < 1e-30, 2.0 ** 100, 1.0)
    inverse = torch.where(finite & (amax > 0), 127.0 / (amax * boost), torch.zeros_like(amax))
    scaled = (w * boost[:, None]).mul_(inverse[:, None])  # rounded and clamped in place: 7 passes, not 9
    q = scaled.round_().clamp_(-127, 127).to(torch.int8)
    q.masked_fill_(~finite[:, None], 0)  # no sync on the values: also on the meta device, and fake tensors
    return q, torch.where(finite, amax / 127.0, torch.full_like(amax, float("nan")))


class QuantizedPass(NamedTuple):
    """One layer-direction's weights for the int8 kernels: ``weights`` with W, R, W_hr int8 (the
    rest float32), and the per-row scales of those three (W_hr_scale None without a projection)."""

    weights: PassWeights
    W_scale: torch.Tensor
    R_scale: torch.Tensor
    W_hr_scale: Optional[torch.Tensor]


# ---- the op ------------------------------------------------------------------------------------

INT8_ARGUMENTS = PASS_ARGUMENTS + (("W_scale", "Tensor"), ("R_scale", "Tensor"), ("W_hr_scale", "Tensor?"))
_NAMES = tuple(name for name, _ in INT8_ARGUMENTS)
_SCHEMA = "(" + ", ".join(f"{kind} {name}" for name, kind in INT8_ARGUMENTS) + ") -> (Tensor y, Tensor h_n, Tensor c_n)"


def _int8_pass(*values):
    from .fused import build

    return tuple(build.extension().pass_forward_int8(*values))


def _int8_pass_fake(*values):
    args = named(values, _NAMES)
    x = args["x"]
    T, B, H, Hr = output_shapes(args)
    c_n = x.new_empty(B, H) if args["mode"] == "lstm" else x.new_empty(0)
    return x.new_empty(T, B, Hr), x.new_empty(B, Hr), c_n


torch.library.define("rnnkit::fused_int8_pass", _SCHEMA)
torch.library.impl("rnnkit::fused_int8_pass", "cpu")(_int8_pass)
torch.library.register_fake("rnnkit::fused_int8_pass")(_int8_pass_fake)


def _on_the_kernels(x: torch.Tensor) -> bool:
    """Whether the int8 kernels can be called directly (`_direct`, and x on the CPU). Elsewhere the
    op goes through the dispatcher: on the meta device its fake implementation gives the shapes
    (the kernels would read memory a meta tensor does not have)."""
    return _direct(x) and x.device.type == "cpu"


class Int8Backend:
    """The fused CPU passes with int8 weights (`QuantizedPass`), for `functional.run_stack`."""

    name = "fused-int8"

    def run_pass(self, cell, x, h0, c0, w: QuantizedPass, lengths, reverse, masks):
        values = pass_values(pass_scalars(cell, reverse, masks), x, h0, c0, tuple(w.weights),
                             mask_tensors(lengths, masks)) + (w.W_scale, w.R_scale, w.W_hr_scale)
        out = _int8_pass(*values) if _on_the_kernels(x) else torch.ops.rnnkit.fused_int8_pass.default(*values)
        return out[0], out[1], (out[2] if cell.mode == "lstm" else None)


INT8 = Int8Backend()


# ---- the modules -------------------------------------------------------------------------------

class _Quantized(_SpecAttributes, nn.Module):
    """A float module's weights, int8 where `MATRICES` says, as buffers under the float module's
    names (plus ``<name>_scale`` for each int8 matrix): state_dicts save with safetensors and load
    into a quantized module of the same configuration."""

    _FLOAT: type = nn.Module

    def __init__(self, source: _PackedModule):
        super().__init__()
        if not isinstance(source, self._FLOAT):
            raise TypeError(f"module: expected an rnnkit.{self._FLOAT.__name__}, got {type(source).__name__}")
        current = source._settled()  # parametrized or pruned weights as they compute now
        if current[0].device.type not in ("cpu", "meta"):  # meta: shapes only (the op's fake implementation)
            raise ValueError(f"module: int8 inference runs on the CPU; move the module there first (it is on "
                             f"{current[0].device})")
        if not current[0].is_floating_point():
            raise TypeError(f"module: expected floating-point weights, got {current[0].dtype}")
        self.spec = source.spec
        self.layout: Layout = source.layout
        self._names = source._names
        for entry, value in zip(source.layout.entries, current):
            value = value.detach()
            if entry.piece in MATRICES:
                q, scale = quantize_rows(value)
                self.register_buffer(entry.name, q)
                self.register_buffer(entry.name + "_scale", scale)
            else:
                self.register_buffer(entry.name, value.to(torch.float32, copy=True).contiguous())
        self.train(source.training)

    def _apply(self, fn, recurse=True):
        """Moves between devices as any module; dtype conversions (``.double()``, ``.half()``,
        ``.to(dtype)``, a containing model's) leave the buffers' dtypes as they are: the kernels take
        int8 matrices with float32 scales and vectors, and float32 inputs. (Converted, no input was
        accepted any more, each refusal pointing elsewhere.)"""
        def same_dtype(t):
            moved = fn(t)
            return moved if moved.dtype == t.dtype else t.to(moved.device)

        return super()._apply(same_dtype, recurse)

    def _load_from_state_dict(self, *args):
        load_checked(self, super()._load_from_state_dict, self._check_loaded, args)

    def _check_loaded(self, state_dict: dict, prefix: str) -> None:
        """Loading checks the int8 matrices: a float matrix (a float module's state dict) is refused by
        name, whatever ``strict`` says (copy_ would truncate it to int8 codes), and so is -128:
        symmetric quantization keeps the codes in [-127, 127], and the kernels rely on it (-128 has
        no negation in int8)."""
        for entry in self.layout.entries:
            value = state_dict.get(prefix + entry.name)
            if entry.piece not in MATRICES or not isinstance(value, torch.Tensor):
                continue
            if value.dtype != torch.int8:
                hint = ("a float module's weights load into the float module, which rnnkit.quantize then quantizes"
                        if value.is_floating_point() else
                        "rnnkit's codes are signed and symmetric (w = scale[row] * q, no zero point); codes of "
                        "another scheme (unsigned, with a zero point, as ONNX's) do not load: quantize the float "
                        "weights with rnnkit.quantize")
                raise ValueError(f"{prefix}{entry.name}: expected int8 codes (with {entry.name}_scale), got "
                                 f"{value.dtype}: {hint}")
            if bool((value == -128).any()):
                raise ValueError(f"{prefix}{entry.name}: expected int8 values in [-127, 127] (symmetric per-row "
                                 f"quantization), got -128 in {int((value == -128).sum())} places")

    @classmethod
    def from_float(cls, module, use_precomputed_fake_quant: bool = False):
        """The quantized counterpart of an rnnkit module (``torch.ao.quantization``'s hook: see
        `dynamic_quant_mapping`). Its qconfig must ask for int8 weights (``torch.qint8``): a float16
        or quint8 qconfig is refused, not quietly given int8 weights."""
        pruned = sorted(pruning_hooks(module))
        if pruned:  # torch.ao's swap carries prune's hook over, which reads <name>_orig on the int8 module
            raise ValueError(f"{type(module).__name__}: {', '.join(pruned)} pruned (torch.nn.utils.prune): its "
                             "forward pre-hook would be carried onto the int8 module, which has no "
                             f"{pruned[0]}_orig to read: use rnnkit.quantize, which quantizes the pruned weights "
                             "and leaves the hook behind, or call torch.nn.utils.prune.remove first")
        qconfig = getattr(module, "qconfig", None)
        if qconfig is not None and getattr(qconfig, "weight", None) is not None:
            dtype = qconfig.weight().dtype
            if dtype != torch.qint8:
                raise ValueError(f"{type(module).__name__}: rnnkit's dynamic quantization makes int8 weights: "
                                 f"expected a qconfig with weight dtype torch.qint8, got {dtype}")
        return cls(module)

    def _check_buffers(self) -> None:
        """The buffers as the kernels take them: int8 matrices, float32 scales and vectors, by name
        (``load_state_dict(..., assign=True)`` and assignment keep what they are given), raising
        the float modules' error classes (`_PackedModule._check_pieces`)."""
        for name, value in self._buffers.items():
            scale = name.endswith("_scale")
            entry = self.layout.index.get(name.removesuffix("_scale"))
            if entry is None:  # a buffer of the user's own
                continue
            matrix = entry.piece in MATRICES and not scale
            dtype, shape = (torch.int8 if matrix else torch.float32), (entry.shape[:1] if scale else entry.shape)
            if not isinstance(value, torch.Tensor) or value.dtype != dtype:
                what = "int8 codes" if matrix else "float32 (an int8 module's scales and vectors are float32)"
                raise DTypeMismatchError(f"{name}: expected {what}, got {getattr(value, 'dtype', type(value).__name__)}")
            if tuple(value.shape) != tuple(shape):
                raise MismatchError(f"{name}: expected shape {tuple(shape)} (this module's layout), got "
                                    f"{tuple(value.shape)}")

    def _passes(self) -> list:
        """One `QuantizedPass` per layer-direction."""
        self._check_buffers()
        b = self._buffers
        grouped = self.layout.group({name: b[name] for name in self._names})
        out = []
        for weights, names in zip(grouped, self.layout.pass_names()):
            scale = lambda slot: b[names[slot] + "_scale"] if slot in names else None  # noqa: E731
            out.append(QuantizedPass(weights, scale("W"), scale("R"), scale("W_hr")))
        return out

    def _like(self) -> torch.Tensor:
        return self._buffers[self._names[0] + "_scale"]  # float32, on the module's device

    def _check_call(self, tensors) -> None:
        if torch.onnx.is_in_onnx_export() and not torch.compiler.is_exporting():
            raise ValueError(f"{type(self).__name__}: int8 modules export to ONNX with torch.onnx.export(..., "
                             "dynamo=True); the TorchScript exporter (dynamo=False) has no translation of their op")
        if torch.compiler.is_exporting():
            return  # an exported graph is for inference: gradients through it are not asked for
        if forward_ad_reason() or (
                torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)):
            raise RuntimeError(f"{type(self).__name__}: an int8 module is for inference and has no gradient; call it "
                               "under torch.no_grad() / torch.inference_mode() with inputs that do not require grad, "
                               "or train the float module")

    def _prepared(self) -> tuple:
        """(one-step plans, passes) on the int8 weights as they are: the fused kernels' one-step plans,
        one per pass (None where a buffer is not contiguous, which the plans cannot take), and the
        checked `_passes`. Built once, rebuilt when a buffer, the memory behind one or its shape or
        layout changes (load_state_dict(assign=True), ``buffer.data = ...``): the check and the
        grouping took 8-10 µs of every call."""
        buffers = tuple(self._buffers.values())
        memory = memory_of(buffers)  # `buffer.data = ...` keeps the object, not the memory
        cached = self.__dict__.get("_plan")
        if cached is None or cached[2] != memory or any(a is not b for a, b in zip(cached[1], buffers)):
            passes, plans = self._passes(), None  # None: the general path
            if all(b.is_contiguous() for b in buffers):  # else e.g. loaded with assign=True
                plans = step_plans(self.spec, [p.weights for p in passes], self._like(),
                                   [(p.W_scale, p.R_scale, p.W_hr_scale) for p in passes])
            cached = StepPlans((plans, buffers, memory, passes))
            self.__dict__["_plan"] = cached
        return cached[0], cached[3]

    def _plans(self) -> Optional[list]:
        return self._prepared()[0]

    def _current_passes(self, x: torch.Tensor) -> list:
        """`_passes`, from `_prepared`'s cache where the call is eager on plain tensors (`_direct`) and so
        are the buffers; elsewhere made anew: torch.compile / export cannot trace the cache's comparison
        of data pointers, and batched (vmap) or fake buffers have none."""
        if _direct(x) and all(type(b) is torch.Tensor for b in self._buffers.values()):
            return self._prepared()[1]
        return self._passes()

    def extra_repr(self) -> str:
        from .spec import RNNSpec

        defaults = RNNSpec(self.spec.mode, 1, 1).options()
        options = self.spec.options()
        hidden = options["hidden_size"]
        parts = [f"{self.spec.input_size}, {hidden}"]
        parts += [f"{k}={v!r}" for k, v in options.items()
                  if k not in ("input_size", "hidden_size", "mode") and v != defaults[k]]
        return ", ".join(parts + ["weights=int8"])


def _widened(value):
    """Under torch.autocast on the CPU (the callers ask), a tensor (or a PackedSequence's data) in its
    dtype widened to float32, exactly: what a layer before an int8 one hands over there (a Linear's
    bfloat16 output). The int8 kernels take float32 and return it, under autocast too."""
    low = torch.get_autocast_dtype("cpu")
    if isinstance(value, nn.utils.rnn.PackedSequence):
        return value._replace(data=_widened(value.data))
    return value.float() if isinstance(value, torch.Tensor) and value.dtype == low and value.device.type == "cpu" \
        else value


class _QuantizedStack(_StackAttributes, _Quantized):
    _FLOAT = _Recurrent

    def flatten_parameters(self) -> None:
        """Nothing to do, as on the float module: the int8 buffers are what the kernels read. Here so
        that a model whose forward calls ``self.rnn.flatten_parameters()`` (torch.nn's idiom) runs
        unchanged once quantized."""

    def forward(self, input, hx=None, lengths=None):
        """As the float module's call (input, hx, lengths; PackedSequence), in evaluation mode."""
        if torch.is_autocast_enabled("cpu"):
            input, hx = _widened(input), functional._map(hx, _widened)
        data = input.data if isinstance(input, nn.utils.rnn.PackedSequence) else input
        self._check_call([data, *functional._leaves(hx)])
        out = planned_call(self.spec, lambda steps, batch: self._plans() if _on_the_kernels(data) else None, input, hx,
                           lengths)
        if out is not None:
            return out
        return functional.sequence_call(self._run, input, hx, lengths, self.spec.batch_first)

    def _run(self, input, hx, lengths, batch_first, padding_unread=False):
        data = input.data if isinstance(input, nn.utils.rnn.PackedSequence) else input
        y, hy, _ = functional.run(self.spec, self._current_passes(data), input, hx, lengths, training=False,
                                  backend=INT8, batch_first=batch_first, like=self._like(),
                                  padding_unread=padding_unread)
        return y, hy


class _QuantizedCell(_CellAttributes, _Quantized):
    _FLOAT = _Cell

    def forward(self, input, hx=None):
        """One step, as the float cell's call (input (B, I) or (I,); hx as the cell takes it)."""
        if torch.is_autocast_enabled("cpu"):
            input, hx = _widened(input), functional._map(hx, _widened)
        check_cell_input(self.spec, input)
        self._check_call([input, *functional._leaves(hx)])
        plans = self._plans() if _on_the_kernels(input) else None
        if plans is not None:
            out = plans[0](input, hx)
            if out is not None:
                return out
        # the general path: a one-step, one-layer stack (the cell's states are the stack's with L·D = 1),
        # its arguments checked first as the float cell checks them (the stack's messages would show
        # the added axes)
        lstm = self.spec.mode == "lstm"
        like = self._like()
        functional.check_tensor("input", input, None, like)
        if hx is not None:
            states = functional.check_cell_states(self.spec, hx, input, like)
            hx = tuple(t.unsqueeze(0) for t in states) if lstm else states[0].unsqueeze(0)
        y, hy, _ = functional.run(self.spec, self._current_passes(input), input.unsqueeze(0), hx, None, training=False,
                                  backend=INT8, batch_first=False, like=like)
        return (hy[0][0], hy[1][0]) if lstm else hy[0]



class LSTM(_QuantizedStack):
    """`rnnkit.LSTM` with int8 weights (made by `quantize`), for inference: the same call and outputs."""

    _FLOAT = float_nn.LSTM


class GRU(_QuantizedStack):
    """`rnnkit.GRU` with int8 weights (made by `quantize`), for inference: the same call and outputs."""

    _FLOAT = float_nn.GRU


class RNN(_QuantizedStack):
    """`rnnkit.RNN` with int8 weights (made by `quantize`), for inference: the same call and outputs."""

    _FLOAT = float_nn.RNN
    nonlinearity = _NONLINEARITY


class LSTMCell(_QuantizedCell):
    """`rnnkit.LSTMCell` with int8 weights (made by `quantize`), for inference: the same call and outputs."""

    _FLOAT = float_nn.LSTMCell


class GRUCell(_QuantizedCell):
    """`rnnkit.GRUCell` with int8 weights (made by `quantize`), for inference: the same call and outputs."""

    _FLOAT = float_nn.GRUCell


class RNNCell(_QuantizedCell):
    """`rnnkit.RNNCell` with int8 weights (made by `quantize`), for inference: the same call and outputs."""

    _FLOAT = float_nn.RNNCell
    nonlinearity = _NONLINEARITY


_QUANTIZED = {float_nn.LSTM: LSTM, float_nn.GRU: GRU, float_nn.RNN: RNN, float_nn.LSTMCell: LSTMCell,
              float_nn.GRUCell: GRUCell, float_nn.RNNCell: RNNCell}


#: The int8 GEMM kernels (csrc/qgemm.cpp), by the names `int8_kernel` and $RNNKIT_INT8_KERNEL use.
#: Every one sums the same products exactly in int32: they give the same outputs bit for bit.
INT8_KERNELS = {
    "amx-int8": "AMX-INT8 (Sapphire Rapids and later Xeons): tdpbssd on tiles of 16 rows x 64 k of the quantized "
                "x and the packed int8 weights, the same exact int32 sums (products of up to 3 rows: avx512-vnni's)",
    "avx512-vnni": "AVX512-VNNI: vpdpbusd on x + 128 as unsigned bytes, less 128·Σw (a one-step call's few rows: "
                   "512-bit, on |x| and ±w for one row)",
    "avx-vnni": "AVX-VNNI: vpdpbusd (VEX) on x + 128 as unsigned bytes, less 128·Σw",
    "avx2": "AVX2: vpmaddubsw on |x| and sign(w, x), pairs summed by vpmaddwd",
    "emulated-vnni": "the VNNI kernels' arithmetic in AVX2 instructions (for tests on CPUs without VNNI)",
    "scalar": "plain C++ loops (a build without AVX2: correct, slower)",
}


def int8_kernel() -> str:
    """The int8 GEMM kernels `quantize`'s modules run on (a key of `INT8_KERNELS`): the fastest
    this CPU has (AMX-INT8, then AVX512-VNNI, then AVX-VNNI, then AVX2), or the one $RNNKIT_INT8_KERNEL names
    (read at the first int8 product; a ValueError if this CPU cannot run it). Loads the fused
    kernels, building them on first use."""
    from .fused import build

    return build.extension().int8_kernel()


def dynamic_quant_mapping() -> dict:
    """``torch.ao.quantization``'s default dynamic mapping plus rnnkit's modules, for
    ``quantize_dynamic(model, {rnnkit.LSTM, nn.Linear, ...}, mapping=rnnkit.quantized.dynamic_quant_mapping())``.
    Its default ``qconfig_spec`` lists torch.nn types only, so name rnnkit's types in it: with the
    defaults it leaves rnnkit layers in float32 (`quantize` has no such trap)."""
    from torch.ao.quantization.quantization_mappings import get_default_dynamic_quant_module_mappings

    mapping = dict(get_default_dynamic_quant_module_mappings())
    mapping.update(_QUANTIZED)
    return mapping


def quantize(module: nn.Module, dtype=torch.qint8) -> nn.Module:
    """int8 dynamic quantization of every rnnkit layer in ``module``, for CPU inference.

    Args:
        module: an rnnkit LSTM / GRU / RNN / LSTMCell / GRUCell / RNNCell, or a model containing
            some (on the CPU, floating-point weights; or on the meta device, where the quantized
            layers give shapes only and take weights by ``load_state_dict(..., assign=True)``).
        dtype: ``torch.qint8`` (or ``torch.int8``), the only one supported.

    Returns:
        A new module (``module`` is not modified): a deep copy in which every rnnkit layer is
        replaced by its quantized counterpart (``rnnkit.quantized.LSTM``, ...), which takes the
        same calls and returns float32 outputs, and keeps the layer's hooks and what was attached
        to it (buffers, submodules, public attributes), deep-copied. Other layers are copied as
        they are.

    Raises:
        ValueError: no rnnkit layer in ``module``, a layer neither on the CPU nor on the meta device,
            or an unsupported dtype.

    Example:
        >>> model = rnnkit.LSTM(32, 64, proj_size=16, layer_norm=True).eval()
        >>> q = rnnkit.quantize(model)
        >>> with torch.no_grad():
        ...     y, (h, c) = q(torch.randn(10, 4, 32))
        >>> safetensors.torch.save_model(q, "q.safetensors")
        >>> again = rnnkit.quantize(rnnkit.LSTM(32, 64, proj_size=16, layer_norm=True))
        >>> safetensors.torch.load_model(again, "q.safetensors")   # the same int8 weights
    """
    if dtype not in (torch.qint8, torch.int8):
        raise ValueError(f"dtype: expected torch.qint8 (int8 weights), got {dtype}")
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected an nn.Module, got {type(module).__name__}")
    # each rnnkit layer's quantized twin, handed to deepcopy as the copy of that layer
    layers = [m for m in module.modules() if isinstance(m, tuple(_QUANTIZED))]
    memo = {id(m): _quantized_twin(m) for m in layers}
    if not memo:
        already = any(isinstance(m, _Quantized) for m in module.modules())
        raise ValueError("module: " + ("already quantized" if already else
                                       f"no rnnkit LSTM / GRU / RNN / cell in {type(module).__name__} to quantize"))
    for layer in layers:  # after every twin is in memo: a layer's extras may refer to other layers
        _carry_extras(layer, memo[id(layer)], memo)
    return memo[id(module)] if id(module) in memo else copy.deepcopy(module, memo)


_INTRINSIC: dict = {}  # float layer type -> the public attributes a new layer of it has


def _carry_extras(layer: nn.Module, twin: "_Quantized", memo: dict) -> None:
    """What a user attached to an rnnkit layer, deep-copied onto its quantized twin (``memo``:
    `quantize`'s deepcopy memo, so that what is shared stays shared): buffers of their own (persistent
    or not), submodules (but the parametrizations, which the twin's weights already include), and
    public attributes a new layer does not have. Dropped, they would vanish without a word, and a
    hook or a state_dict that reads them would fail or, worse, load elsewhere."""
    kind = nn.utils.parametrize.type_before_parametrizations(layer)
    if kind not in _INTRINSIC:
        _INTRINSIC[kind] = {k for k in vars(kind(1, 1)) if not k.startswith("_")}
    pruned = pruning_hooks(layer)  # prune's mask and masked weight: in the twin's weights already
    for name, value in layer._buffers.items():
        if name.endswith("_mask") and name[:-len("_mask")] in pruned:
            continue
        if name in twin._buffers:
            raise ValueError(f"module: a buffer of its own named {name!r} on {kind.__name__} clashes with the int8 "
                             "module's buffer of that name: rename it before quantizing")
        twin.register_buffer(name, copy.deepcopy(value, memo), persistent=name not in layer._non_persistent_buffers_set)
    for name, child in layer._modules.items():
        if name != "parametrizations" or not nn.utils.parametrize.is_parametrized(layer):
            twin.add_module(name, copy.deepcopy(child, memo))
    for name, value in vars(layer).items():
        if not name.startswith("_") and name not in _INTRINSIC[kind] and name not in vars(twin) and name not in pruned:
            setattr(twin, name, copy.deepcopy(value, memo))


def _quantized_twin(module: nn.Module) -> _Quantized:
    """The int8 counterpart of one rnnkit layer: a parametrized or pruned layer's weights as they
    compute now, and its forward pre-hooks and hooks carried over (as torch.ao's swap_module does),
    so that they keep firing on the quantized layer rather than vanish; but prune's, whose masked
    weights the int8 ones are (it would read the ``<name>_orig`` parameter the twin has not)."""
    target = _QUANTIZED.get(nn.utils.parametrize.type_before_parametrizations(module))
    if target is None:
        raise ValueError(f"module: {type(module).__name__} subclasses an rnnkit layer, and its forward may differ from "
                         "the layer's: quantize the rnnkit layers inside it instead")
    twin = target(module)
    pruning = list(pruning_hooks(module).values())
    for key, hook in module._forward_pre_hooks.items():
        if not any(hook is p for p in pruning):
            twin.register_forward_pre_hook(hook, with_kwargs=key in module._forward_pre_hooks_with_kwargs)
    for key, hook in module._forward_hooks.items():
        twin.register_forward_hook(hook, with_kwargs=key in module._forward_hooks_with_kwargs,
                                   always_call=key in module._forward_hooks_always_called)
    return twin


__all__ = ["quantize", "quantize_rows", "dynamic_quant_mapping", "QuantizedPass", "LSTM", "GRU", "RNN", "LSTMCell",
           "GRUCell", "RNNCell"]
