"""A character language model on an rnnkit stack: corpus, batching, training, checkpoints, sampling.

The model is ``embedding -> rnnkit LSTM/GRU/RNN stack -> linear`` over characters. Training
is truncated backpropagation through time (BPTT): the text is cut into ``batch`` parallel
streams, read ``bptt`` characters at a time, and the recurrent state is carried from one
chunk to the next but detached between them, so gradients stop at chunk boundaries.

Everything that decides the result of a run (weights, optimizer moments, the carried
state, the random generator and the read position) is in the checkpoint, so a resumed run
computes exactly what the uninterrupted run computes. The ``rnnkit`` command (cli.py) is a
thin layer over this module; ``examples/ddp.py`` reuses it.

Checkpoint directory (every file is written to a temporary name, then ``os.replace``-d):

    config.json              model and training configuration, corpus fingerprint
    vocab.json               the characters, in id order
    checkpoint.safetensors   model.* (torch.nn state_dict names), optimizer.*, state.*, rng.torch;
                             step, read position and counters in the metadata
    log.jsonl                one JSON record per evaluation
    curve.png                the learning curve
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import os
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

import rnnkit

FORMAT = "rnnkit-charlm/1"
CONFIG_FILE, VOCAB_FILE, CHECKPOINT_FILE = "config.json", "vocab.json", "checkpoint.safetensors"
LOG_FILE, CURVE_FILE = "log.jsonl", "curve.png"
DEFAULT_CORPUS_CHARS = 1_000_000  # the stdlib corpus: this many characters of sorted *.py files
VALID_FRACTION = 0.05  # the tail of the corpus held out for validation
CELLS = ("lstm", "gru", "rnn_tanh", "rnn_relu")


class UserError(Exception):
    """A problem with what the user asked for or gave us; the message is one line, shown as is."""


# ---- configuration -------------------------------------------------------------------

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


@dataclass(frozen=True)
class TrainConfig:
    """How it is trained; with ModelConfig and the corpus, this fixes every number of a run."""

    seed: int = 0
    bptt: int = 64
    batch: int = 32
    lr: float = 3e-3
    clip: float = 1.0


# the flags whose values are part of a run's identity, with their defaults
MODEL_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name != "vocab_size"}
TRAIN_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig)}


# ---- corpus and vocabulary -----------------------------------------------------------

def stdlib_corpus(chars: int = DEFAULT_CORPUS_CHARS) -> str:
    """The default corpus: Python's own standard library, which every installation has.

    The top-level ``*.py`` files of ``sysconfig.get_paths()["stdlib"]`` in sorted order,
    concatenated and cut to ``chars`` characters.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(text)
        total += len(text)
        if total >= chars:
            break
    text = "".join(parts)[:chars]
    if not text:
        raise UserError(f"no readable .py files in the standard library at {root}; pass --text FILE")
    return text


def read_corpus(path: str) -> str:
    """A UTF-8 text file, or a one-line UserError saying what is wrong with it."""
    file = Path(path)
    if not file.exists():
        raise UserError(f"--text {path}: no such file")
    if not file.is_file():
        raise UserError(f"--text {path}: not a regular file")
    try:
        data = file.read_bytes()
    except OSError as error:
        raise UserError(f"--text {path}: cannot read it ({error.strerror})") from None
    if not data.strip():
        raise UserError(f"--text {path}: the file is empty")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UserError(f"--text {path}: not UTF-8 text (invalid byte at offset {error.start})") from None


def fingerprint(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class Vocabulary:
    """The characters of a corpus, sorted; id k is ``chars[k]``."""

    def __init__(self, chars: Sequence[str]):
        self.chars = list(chars)
        self.index = {ch: k for k, ch in enumerate(self.chars)}

    @classmethod
    def of(cls, text: str) -> "Vocabulary":
        return cls(sorted(set(text)))

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """-> int64 tensor [len(text)]; a UserError names characters the vocabulary lacks."""
        missing = sorted(set(text) - self.index.keys())
        if missing:
            raise UserError(f"characters not in the model's vocabulary: {''.join(missing)!r}")
        return torch.tensor([self.index[ch] for ch in text], dtype=torch.int64)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(k)] for k in ids)


def split(text: str, valid_fraction: float = VALID_FRACTION, block: int = 50_000) -> Tuple[str, str]:
    """-> (train, validation): the tail ``valid_fraction`` of every ``block`` characters is held out.

    Holding out a slice of each block, rather than the corpus' last file, keeps the
    validation text like the training text (the stdlib corpus is sorted by file name).
    """
    train, valid = [], []
    for start in range(0, len(text), block):
        piece = text[start : start + block]
        cut = len(piece) - max(2, int(len(piece) * valid_fraction))
        train.append(piece[:cut])
        valid.append(piece[cut:])
    return "".join(train), "".join(valid)


# ---- the model -----------------------------------------------------------------------

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


def build_model(config: ModelConfig, backend: str = "auto") -> CharLM:
    """CharLM, with rnnkit's argument errors turned into one-line UserErrors."""
    try:
        return CharLM(config, backend)
    except rnnkit.BackendUnavailableError as error:
        raise UserError(str(error)) from None
    except (ValueError, TypeError) as error:
        flag = {"peephole": "--peephole", "proj_size": "--proj", "layer_norm": "--layer-norm",
                "zoneout": "--zoneout", "dropout": "--dropout"}
        message = str(error)
        for option, name in flag.items():
            if message.startswith(option + ":"):
                message = f"{name}: {message[len(option) + 1:].strip()}"
                break
        raise UserError(f"{message} (with --cell {config.cell})") from None


def state_tensors(state) -> List[torch.Tensor]:
    """The carried state as a flat list: [h] or [h, c]."""
    if state is None:
        return []
    return list(state) if isinstance(state, tuple) else [state]


def detach(state):
    """Cut the graph at a chunk boundary (truncated BPTT); the values carry on."""
    if isinstance(state, tuple):
        return tuple(s.detach() for s in state)
    return state.detach()


# ---- batching into parallel streams --------------------------------------------------

class Streams:
    """A text cut into ``batch`` parallel streams, read in chunks of ``bptt`` characters.

    Stream b is the b-th contiguous slice of the text, so consecutive chunks continue each
    stream and the carried state stays meaningful. Chunk k holds inputs [bptt, batch] and
    the next characters as targets. Only whole chunks are read; after the last one the
    read wraps to chunk 0 (a new epoch) with a fresh state.
    """

    def __init__(self, ids: torch.Tensor, batch: int, bptt: int, what: str = "the training text"):
        length = (len(ids) - 1) // batch
        if length < bptt:
            need = batch * bptt + 1
            raise UserError(
                f"{what} has {len(ids)} characters, too few for --batch {batch} x --bptt {bptt} "
                f"(needs at least {need}); use a longer --text or smaller --batch/--bptt"
            )
        self.inputs = ids[: batch * length].view(batch, length).t().contiguous()  # [L, B]
        self.targets = ids[1 : batch * length + 1].view(batch, length).t().contiguous()  # [L, B]
        self.bptt = bptt
        self.chunks = length // bptt

    def chunk(self, position: int, streams: slice = slice(None)) -> Tuple[torch.Tensor, torch.Tensor]:
        """Chunk ``position`` (taken modulo the number of chunks) -> (inputs, targets), each [bptt, b]."""
        start = (position % self.chunks) * self.bptt
        rows = slice(start, start + self.bptt)
        return self.inputs[rows, streams], self.targets[rows, streams]


def evaluate(model: CharLM, ids: torch.Tensor, batch: int, bptt: int) -> float:
    """Bits per character of ``ids`` (the model predicts ids[1:] from what precedes)."""
    batch = max(1, min(batch, (len(ids) - 1) // bptt))
    length = (len(ids) - 1) // batch
    inputs = ids[: batch * length].view(batch, length).t()
    targets = ids[1 : batch * length + 1].view(batch, length).t()
    was_training = model.training
    model.eval()
    total, count, state = 0.0, 0, None
    with torch.no_grad():
        for start in range(0, length, bptt):
            logits, state = model(inputs[start : start + bptt], state)
            target = targets[start : start + bptt]
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum").item()
            count += target.numel()
    model.train(was_training)
    return total / count / math.log(2)


# ---- one training step ---------------------------------------------------------------

def make_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=config.lr)


def train_step(model, optimizer, x, y, state, clip: float):
    """One truncated-BPTT step on chunk (x, y) -> (mean loss in nats, detached state)."""
    model.train()
    logits, state = model(x, state)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if clip:
        nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    return loss.item(), detach(state)


# ---- files ---------------------------------------------------------------------------

def atomic_write(path: Path, data: bytes) -> None:
    """Write to a temporary name beside ``path``, fsync, then os.replace: never a half file."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()


def write_json(path: Path, value) -> None:
    atomic_write(path, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def read_json(path: Path, what: str):
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: missing ({what})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"{path}: unreadable {what} ({type(error).__name__}: {error})".splitlines()[0]) from None


def require_safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise UserError("checkpoints need the safetensors package: pip install 'rnnkit[cli]'") from None
    return safetensors.torch


@dataclass
class Progress:
    """Where a run stands, beyond weights and optimizer: saved in the checkpoint's metadata."""

    step: int = 0
    position: int = 0  # the next chunk to read
    elapsed: float = 0.0  # training seconds so far
    interval_loss: float = 0.0  # loss summed since the last evaluation
    interval_steps: int = 0
    interval_seconds: float = 0.0


def save_checkpoint(directory: Path, model: nn.Module, optimizer, state, progress: Progress) -> None:
    """Weights (torch.nn names), optimizer state, carried state, RNG state and progress, atomically."""
    st = require_safetensors()
    # clone: state_dict entries are views of one packed buffer, and safetensors refuses shared storage
    tensors = {f"model.{k}": v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    saved = optimizer.state_dict()
    for index, entry in saved["state"].items():
        for key, value in entry.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"optimizer state {key!r} is not a tensor; cannot store it")
            tensors[f"optimizer.{index}.{key}"] = value.detach().clone().contiguous()
    for k, tensor in enumerate(state_tensors(state)):
        tensors[f"state.{k}"] = tensor.detach().clone().contiguous()
    tensors["rng.torch"] = torch.get_rng_state()
    metadata = {
        "format": FORMAT,
        "progress": json.dumps(dataclasses.asdict(progress)),
        "param_groups": json.dumps(saved["param_groups"]),
    }
    atomic_write(Path(directory) / CHECKPOINT_FILE, st.save(tensors, metadata=metadata))


def read_checkpoint(directory: Path) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """-> (tensors, metadata) of a checkpoint file, or a one-line UserError if it is damaged."""
    path = Path(directory) / CHECKPOINT_FILE
    st = require_safetensors()
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{path}: no checkpoint there") from None
    except OSError as error:
        raise UserError(f"{path}: cannot read it ({error.strerror})") from None
    try:
        tensors = st.load(data)
        from safetensors import safe_open  # metadata is only reachable through a file handle

        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
    except Exception as error:  # safetensors raises its own error types for damaged files
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UserError(f"{path}: corrupted or truncated checkpoint ({reason})") from None
    if metadata.get("format") != FORMAT:
        raise UserError(f"{path}: not an rnnkit character-model checkpoint (format {metadata.get('format')!r})")
    return tensors, metadata


def load_checkpoint(directory: Path, model: nn.Module, optimizer=None):
    """Restore a checkpoint into ``model`` (and ``optimizer``) -> (state, progress, rng_state)."""
    path = Path(directory) / CHECKPOINT_FILE
    tensors, metadata = read_checkpoint(directory)
    weights = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    try:
        model.load_state_dict(weights, strict=True)
        progress = Progress(**json.loads(metadata["progress"]))
        if optimizer is not None:
            entries: Dict[int, Dict[str, torch.Tensor]] = {}
            for key, value in tensors.items():
                if key.startswith("optimizer."):
                    _, index, name = key.split(".", 2)
                    entries.setdefault(int(index), {})[name] = value
            optimizer.load_state_dict({"state": entries, "param_groups": json.loads(metadata["param_groups"])})
    except (RuntimeError, KeyError, ValueError, TypeError) as error:
        reason = str(error).strip().splitlines()[0]
        raise UserError(f"{path}: does not match {CONFIG_FILE} ({reason})") from None
    carried = [tensors[f"state.{k}"] for k in range(2) if f"state.{k}" in tensors]
    state = None if not carried else (tuple(carried) if len(carried) == 2 else carried[0])
    return state, progress, tensors.get("rng.torch")


def model_config_from(directory: Path) -> Tuple[ModelConfig, dict, Vocabulary]:
    """Read config.json and vocab.json -> (ModelConfig, the whole config, Vocabulary)."""
    directory = Path(directory)
    config = read_json(directory / CONFIG_FILE, "run configuration")
    chars = read_json(directory / VOCAB_FILE, "vocabulary")
    try:
        if config.get("format") != FORMAT:
            raise ValueError(f"format {config.get('format')!r}")
        model = ModelConfig(**config["model"])
        vocabulary = Vocabulary(chars)
        if len(vocabulary) != model.vocab_size or not all(isinstance(c, str) and len(c) == 1 for c in chars):
            raise ValueError("vocabulary does not match vocab_size")
    except (AttributeError, KeyError, TypeError, ValueError) as error:
        raise UserError(f"{directory / CONFIG_FILE}: not a usable run configuration ({error})") from None
    return model, config, vocabulary


# ---- the log and the learning curve --------------------------------------------------

def append_log(directory: Path, record: dict) -> None:
    with open(Path(directory) / LOG_FILE, "a", encoding="utf-8") as file:
        file.write(json.dumps(record) + "\n")


def read_log(directory: Path) -> List[dict]:
    path = Path(directory) / LOG_FILE
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash
        records.append(record)
    return records


def plot_curve(directory: Path) -> Optional[str]:
    """Draw curve.png from log.jsonl; -> None, or a one-line note saying why there is no plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no learning-curve plot: matplotlib is not installed (pip install 'rnnkit[cli]')"
    records = read_log(directory)
    if not records:
        return None
    figure, axes = plt.subplots(figsize=(6, 4))
    steps = [r["step"] for r in records]
    axes.plot(steps, [r["train_bpc"] for r in records], label="training")
    axes.plot(steps, [r["val_bpc"] for r in records], label="validation")
    axes.set_xlabel("step")
    axes.set_ylabel("bits per character")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    plt.close(figure)
    atomic_write(Path(directory) / CURVE_FILE, buffer.getvalue())
    return None


# ---- training ------------------------------------------------------------------------

@dataclass
class Run:
    """A training run ready to go: model, optimizer, data and where it stands."""

    directory: Path
    model: CharLM
    optimizer: torch.optim.Optimizer
    train: Streams
    valid_ids: torch.Tensor
    config: TrainConfig
    state: object = None
    progress: Progress = dataclasses.field(default_factory=Progress)


def prepare(directory: Path, model_config: ModelConfig, train_config: TrainConfig, vocabulary: Vocabulary,
            train_text: str, valid_text: str, corpus: dict, backend: str = "auto", resume: bool = False,
            settings: Optional[dict] = None) -> Run:
    """Build the model and data; restore the checkpoint when resuming, else write config and vocabulary.

    ``settings`` (e.g. the evaluation interval) go into config.json, for a resumed run to reuse.
    """
    directory = Path(directory)
    torch.manual_seed(train_config.seed)
    model = build_model(model_config, backend)
    optimizer = make_optimizer(model, train_config)
    streams = Streams(vocabulary.encode(train_text), train_config.batch, train_config.bptt)
    valid_ids = vocabulary.encode(valid_text)
    if len(valid_ids) < 2:
        raise UserError("the validation text is too short; use a longer --text")
    run = Run(directory, model, optimizer, streams, valid_ids, train_config)
    if resume:
        run.state, run.progress, rng = load_checkpoint(directory, model, optimizer)
        if rng is not None:
            torch.set_rng_state(rng)
    else:
        directory.mkdir(parents=True, exist_ok=True)
        write_json(directory / CONFIG_FILE, {
            "format": FORMAT,
            "model": dataclasses.asdict(model_config),
            "training": dataclasses.asdict(train_config),
            "corpus": corpus,
            "settings": settings or {},
            "rnnkit": rnnkit.__version__,
            "torch": torch.__version__,
        })
        write_json(directory / VOCAB_FILE, vocabulary.chars)
        log = directory / LOG_FILE
        if log.exists():
            log.unlink()  # a log without a checkpoint describes nothing that was kept
    return run


def train(run: Run, steps: int, eval_every: int, eval_chars: int,
          on_step: Callable[[int, float, float], None] = lambda step, loss, chars_per_sec: None,
          on_eval: Callable[[dict], None] = lambda record: None) -> None:
    """Train until ``steps``, evaluating and checkpointing every ``eval_every`` steps and at the end.

    ``on_step(step, loss_nats, chars_per_second)`` after each step; ``on_eval(record)`` after
    each evaluation, with the record appended to log.jsonl.
    """
    model, optimizer, config, progress = run.model, run.optimizer, run.config, run.progress
    chars_per_step = config.batch * config.bptt
    valid_ids = run.valid_ids[: eval_chars + 1]
    while progress.step < steps:
        started = time.perf_counter()
        if progress.position % run.train.chunks == 0:
            run.state = None  # a new epoch starts each stream from the beginning of its slice
        x, y = run.train.chunk(progress.position)
        loss, run.state = train_step(model, optimizer, x, y, run.state, config.clip)
        if not math.isfinite(loss):
            raise UserError(f"the loss became {loss} at step {progress.step + 1}; try a smaller --lr")
        seconds = time.perf_counter() - started
        progress.step += 1
        progress.position = (progress.position + 1) % run.train.chunks
        progress.elapsed += seconds
        progress.interval_loss += loss
        progress.interval_steps += 1
        progress.interval_seconds += seconds
        on_step(progress.step, loss, chars_per_step / max(seconds, 1e-9))
        if progress.step % eval_every == 0 or progress.step == steps:
            train_loss = progress.interval_loss / progress.interval_steps
            record = {
                "step": progress.step,
                "train_loss": train_loss,
                "train_bpc": train_loss / math.log(2),
                "val_bpc": evaluate(model, valid_ids, config.batch, config.bptt),
                "chars_per_sec": chars_per_step * progress.interval_steps / max(progress.interval_seconds, 1e-9),
                "elapsed_s": progress.elapsed,
            }
            if progress.step % eval_every == 0:  # the end of a run does not end an interval, so resuming keeps them
                progress.interval_loss, progress.interval_steps, progress.interval_seconds = 0.0, 0, 0.0
            save_checkpoint(run.directory, model, optimizer, run.state, progress)
            append_log(run.directory, record)
            on_eval(record)


# ---- sampling ------------------------------------------------------------------------

def sample(model: CharLM, vocabulary: Vocabulary, prime: str, length: int, temperature: float = 1.0,
           seed: int = 0) -> str:
    """Continue ``prime`` by ``length`` characters, one step at a time with the carried state.

    The prime runs through the stack in one call; then each new character is fed back as a
    one-step sequence with the state of the previous step. ``temperature`` 0 is greedy.
    The same seed gives the same text.
    """
    if not prime:
        raise UserError("--prime: needs at least one character")
    try:
        ids = vocabulary.encode(prime)
    except UserError as error:
        raise UserError(f"--prime: {error}") from None
    generator = torch.Generator().manual_seed(seed)
    model.eval()
    out = []
    with torch.no_grad():
        logits, state = model(ids.view(-1, 1))  # [T, 1, V]
        for _ in range(length):
            scores = logits[-1, 0].double()
            if temperature == 0:
                next_id = int(scores.argmax())
            else:
                probabilities = torch.softmax(scores / temperature, dim=0)
                next_id = int(torch.multinomial(probabilities, 1, generator=generator))
            out.append(next_id)
            logits, state = model(torch.tensor([[next_id]]), state)
    return prime + vocabulary.decode(out)
