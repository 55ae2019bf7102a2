"""What is measured: the shapes of BENCH.md and the cell variants, each a named registry entry.

Adding a shape or a variant is one entry here; the runners and the protocol read them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Tuple


@dataclass(frozen=True)
class Shape:
    """T steps, B batch, I input, H hidden, L layers (BENCH.md's table)."""

    name: str
    T: int
    B: int
    I: int  # noqa: E741 (BENCH.md's letter)
    H: int
    L: int
    why: str = ""


def _shapes(*entries: Shape) -> Dict[str, Shape]:
    return {s.name: s for s in entries}


SHAPES: Dict[str, Shape] = _shapes(
    Shape("stream", 200, 1, 128, 256, 1, "batch-1 latency, generation"),
    Shape("small", 100, 16, 128, 128, 2, "overhead-bound"),
    Shape("medium", 100, 32, 256, 256, 2, "typical"),
    Shape("fastrnns", 100, 64, 512, 512, 1, "PyTorch's own RNN benchmark shape"),
    Shape("wide", 25, 32, 1024, 1024, 1, "DeepBench-style, GEMM-bound"),
    *(
        Shape(f"deepbench-h{H}-b{B}", 25, B, H, H, 1, "DeepBench training shape")
        for H in (512, 1024, 2048)
        for B in (16, 32, 64)
    ),
    Shape("long-h768", 1024, 16, 768, 768, 1, "long sequence"),
    Shape("tiny", 6, 3, 8, 16, 2, "smoke test (--quick)"),
    # the step API: T calls of one step each, the loop of a generation (BENCH.md "Also measured")
    Shape("step128", 100, 1, 128, 128, 1, "step API, per-step cost (generation), H=128"),
    Shape("step512", 100, 1, 512, 512, 1, "step API, per-step cost (generation), H=512"),
    Shape("step512-b4", 100, 4, 512, 512, 1, "step API, a batch of 4 (a beam of 4), H=512"),
    Shape("step-tiny", 5, 1, 8, 16, 1, "step API smoke test (--step --quick)"),
)

CPU_GRID: Tuple[str, ...] = ("stream", "small", "medium", "fastrnns", "wide")
GPU_GRID: Tuple[str, ...] = CPU_GRID + tuple(n for n in SHAPES if n.startswith("deepbench-")) + ("long-h768",)
QUICK_GRID: Tuple[str, ...] = ("tiny",)
STEP_GRID: Tuple[str, ...] = ("step128", "step512", "step512-b4")
QUICK_STEP_GRID: Tuple[str, ...] = ("step-tiny",)


@dataclass(frozen=True)
class Variant:
    """A cell configuration, built as an rnnkit module from a shape.

    ``options(shape)`` gives the module's keyword arguments beyond (input_size, hidden_size,
    num_layers), and may override those three. ``torch_nn`` says whether torch.nn can run
    this variant itself; when it cannot, torch.nn's plain cell of the same mode and shape
    is timed as the baseline the speedups refer to (``plain``).

    ``api`` is how the time steps are run: "sequence" (one call over all T steps),
    "cell" (a one-step cell, rnnkit.LSTMCell / torch.nn.LSTMCell, called once per step with
    the carried state) or "module_step" (the sequence module called with T=1, once per step).
    The step APIs are timed under no_grad only, one layer, as generation uses them.

    ``lengths`` makes the batch variable-length (BENCH.md: lengths spread evenly from T/8 to
    T, in shuffled order): "lengths" calls rnnkit with ``lengths=`` on the padded batch,
    "packed" with a PackedSequence; torch.nn always runs the same batch as a PackedSequence
    (``enforce_sorted=False``), the only way it takes variable lengths.
    """

    name: str
    mode: str  # "lstm", "gru", "rnn_tanh"
    title: str
    torch_nn: bool = False
    options: Callable[[Shape], dict] = field(default=lambda shape: {})
    api: str = "sequence"
    lengths: str = ""  # "", "lengths" or "packed"

    @property
    def modes(self) -> Tuple[str, ...]:
        return ("inference", "training") if self.api == "sequence" else ("inference",)

    @property
    def plain(self) -> str:
        """The plain variant of the same mode: torch.nn's stand-in for this one."""
        return self.mode

    def module_kwargs(self, shape: Shape) -> dict:
        kwargs = {"input_size": shape.I, "hidden_size": shape.H, "num_layers": shape.L}
        kwargs.update(self.options(shape))
        return kwargs


def _variants(*entries: Variant) -> Dict[str, Variant]:
    return {v.name: v for v in entries}


VARIANTS: Dict[str, Variant] = _variants(
    Variant("lstm", "lstm", "LSTM", torch_nn=True),
    Variant("gru", "gru", "GRU", torch_nn=True),
    Variant("rnn_tanh", "rnn_tanh", "RNN tanh", torch_nn=True),
    Variant("lstm_peephole", "lstm", "LSTM + peephole", options=lambda s: {"peephole": True}),
    Variant("lstm_layer_norm", "lstm", "LSTM + layer norm", options=lambda s: {"layer_norm": True}),
    Variant("lstm_zoneout", "lstm", "LSTM + zoneout 0.1", options=lambda s: {"zoneout": 0.1}),
    Variant("lstm_proj", "lstm", "LSTM + projection P=H/2", torch_nn=True, options=lambda s: {"proj_size": s.H // 2}),
    # torch.nn runs per-layer sizes as a chain of one-layer modules, what users write today
    Variant(
        "lstm_per_layer", "lstm", "LSTM stack, hidden [H, H/2]", torch_nn=True,
        options=lambda s: {"hidden_size": [s.H, s.H // 2], "num_layers": 2},
    ),
    Variant("gru_layer_norm", "gru", "GRU + layer norm", options=lambda s: {"layer_norm": True}),
    Variant("gru_reset_before", "gru", "GRU reset_after=False", options=lambda s: {"reset_after": False}),
    Variant("lstm_lengths", "lstm", "LSTM, lengths T/8..T via lengths=", torch_nn=True, lengths="lengths"),
    Variant("lstm_packed", "lstm", "LSTM, lengths T/8..T via PackedSequence", torch_nn=True, lengths="packed"),
    Variant("lstm_cell", "lstm", "LSTMCell, one call per step", torch_nn=True, api="cell"),
    Variant("gru_cell", "gru", "GRUCell, one call per step", torch_nn=True, api="cell"),
    Variant("lstm_t1", "lstm", "LSTM called with T=1, one call per step", torch_nn=True, api="module_step"),
)

DEFAULT_VARIANTS: Tuple[str, ...] = tuple(name for name, v in VARIANTS.items() if v.api == "sequence")
STEP_VARIANTS: Tuple[str, ...] = tuple(name for name, v in VARIANTS.items() if v.api != "sequence")


def lookup(kind: str, registry: dict, names) -> list:
    """Registry entries by name, or a ValueError naming the unknown one and the choices."""
    entries = []
    for name in names:
        if name not in registry:
            raise ValueError(f"{kind}: unknown name {name!r}; expected one of {', '.join(registry)}")
        entries.append(registry[name])
    return entries
