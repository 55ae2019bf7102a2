"""The network: embedding -> rnnkit LSTM/GRU/RNN stack -> linear, and its configuration."""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import nn

import rnnkit

from ..errors import UserError

CELLS = ("lstm", "gru", "rnn_tanh", "rnn_relu")


def flag(name: str) -> str:
    """The command-line flag of a configuration field: ``warmup_steps`` -> ``--warmup-steps``."""
    return "--" + name.replace("_", "-")


def require_int(name: str, value, minimum: int, maximum: Optional[int] = None) -> None:
    """A ValueError naming the field's flag unless ``value`` is an int (not a bool) >= ``minimum``
    (and <= ``maximum``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (maximum is not None and
                                                                                    value > maximum):
        expected = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        if maximum is not None:
            expected = f"an integer from {minimum} to {maximum:,}"
        raise ValueError(f"{flag(name)}: expected {expected}, got {value!r}")


# The largest sizes a configuration may name: a width past 2^24 (a 2^50-value matrix) or a stack
# past 1,024 layers fits no machine's memory, and larger ones overflow the sizes' arithmetic
# before any memory is asked for (build_model then checks what the parameters need).
MAX_WIDTH, MAX_LAYERS = 1 << 24, 1024


def require_number(name: str, value, expected: str, test) -> None:
    """A ValueError naming the field's flag unless ``value`` is a finite int or float passing ``test``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not test(value):
        raise ValueError(f"{flag(name)}: expected {expected}, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """What the network is: the flags --cell, --hidden, --layers, --peephole, ... of ``rnnkit train``."""

    vocab_size: int
    cell: str = "lstm"
    hidden: int = 256
    layers: int = 1
    embedding: int = 64
    peephole: bool = False
    layer_norm: bool = False
    zoneout: float = 0.0
    dropout: float = 0.0
    proj: int = 0

    def __post_init__(self):
        # a config.json edited by hand reaches here too: every value is checked, by its flag's name
        if isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int) or self.vocab_size < 1:
            raise ValueError(f"vocab_size: expected a positive integer, got {self.vocab_size!r}")
        if self.cell not in CELLS:
            raise ValueError(f"--cell: expected one of {', '.join(CELLS)}, got {self.cell!r}")
        for name in ("hidden", "embedding"):
            require_int(name, getattr(self, name), 1, MAX_WIDTH)
        require_int("layers", self.layers, 1, MAX_LAYERS)
        require_int("proj", self.proj, 0, MAX_WIDTH)
        for name in ("peephole", "layer_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{flag(name)}: expected true or false, got {getattr(self, name)!r}")
        for name in ("zoneout", "dropout"):
            require_number(name, getattr(self, name), "a probability in [0, 1)", lambda v: 0 <= v < 1)


# the flags whose values are part of a run's identity, with their defaults
MODEL_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name != "vocab_size"}

_STACKS = {"lstm": rnnkit.LSTM, "gru": rnnkit.GRU}


class CharLM(nn.Module):
    """embedding -> rnnkit stack -> linear: next-character logits.

    Dropout (``config.dropout``) acts on the embedded input, between layers and on the top
    layer's output; zoneout, layer norm, peepholes and projection are the stack's options.

    ``forward(x [T, B] int64, state or None) -> (logits [T, B, V], state)``; ``state`` is the
    stack's (h_n, c_n) for LSTM, h_n otherwise.
    """

    def __init__(self, config: ModelConfig, backend: str = "auto"):
        super().__init__()
        self.config = config
        options = {"backend": backend}
        if config.layers > 1 and config.dropout:
            options["dropout"] = config.dropout
        if config.zoneout:
            options["zoneout"] = config.zoneout
        if config.layer_norm:
            options["layer_norm"] = True
        if config.peephole:
            options["peephole"] = True
        if config.proj:
            options["proj_size"] = config.proj
        self.embedding = nn.Embedding(config.vocab_size, config.embedding)
        if config.cell in _STACKS:
            self.rnn = _STACKS[config.cell](config.embedding, config.hidden, config.layers, **options)
        else:
            nonlinearity = config.cell.split("_")[1]
            self.rnn = rnnkit.RNN(config.embedding, config.hidden, config.layers, nonlinearity=nonlinearity, **options)
        self.drop = nn.Dropout(config.dropout)
        self.head = nn.Linear(config.proj or config.hidden, config.vocab_size)

    def forward(self, x: torch.Tensor, state=None):
        y, state = self.rnn(self.drop(self.embedding(x)), state)  # y: [T, B, Hr]
        return self.head(self.drop(y)), state


_FLAGS = {"peephole": "--peephole", "proj_size": "--proj", "layer_norm": "--layer-norm",
          "zoneout": "--zoneout", "dropout": "--dropout", "backend": "--backend"}


def memory_bytes() -> Optional[int]:
    """This machine's physical memory, or None where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def build_model(config: ModelConfig, backend: str = "auto") -> CharLM:
    """CharLM on the CPU, with rnnkit's argument errors turned into one-line UserErrors naming the flag.
    A model whose parameters alone exceed the machine's memory is refused before any is allocated."""
    try:
        with torch.device("meta"):  # sizes only: nothing allocated
            parameters = sum(p.numel() for p in CharLM(config, "reference").parameters())
    except (ValueError, TypeError):
        parameters = 0  # the same error comes below, from the real construction, with its flag
    memory = memory_bytes()
    if memory is not None and parameters * 4 > memory:
        raise UserError(f"the model does not fit in memory: its {parameters:,} parameters alone take "
                        f"{parameters * 4 / 2**30:,.1f} GiB, this machine has {memory / 2**30:,.1f} GiB; choose a "
                        f"smaller --hidden, --embedding or --layers")
    try:
        return CharLM(config, backend)
    except rnnkit.BackendUnavailableError as error:
        raise UserError(f"--backend {backend}: {error}") from None
    except RuntimeError as error:
        if "alloc" not in str(error):
            raise
        raise UserError(f"the model does not fit in memory ({str(error).strip().splitlines()[0]}); choose a smaller "
                        f"--hidden, --embedding or --layers") from None
    except (ValueError, TypeError) as error:
        message = str(error)
        for option, flag in _FLAGS.items():
            if message.startswith(option + ":"):
                message = f"{flag}: {message[len(option) + 1:].strip()}"
                break
        raise UserError(f"{message} (with --cell {config.cell})") from None


def state_tensors(state) -> List[torch.Tensor]:
    """The carried state as a flat list: [] (none yet), [h] or [h, c]."""
    if state is None:
        return []
    return list(state) if isinstance(state, tuple) else [state]


def state_from_tensors(tensors: List[torch.Tensor]):
    """The inverse of `state_tensors`."""
    if not tensors:
        return None
    return tuple(tensors) if len(tensors) == 2 else tensors[0]


def detach(state):
    """Cut the graph at a chunk boundary (truncated BPTT); the values carry on."""
    if isinstance(state, tuple):
        return tuple(s.detach() for s in state)
    return state.detach()
