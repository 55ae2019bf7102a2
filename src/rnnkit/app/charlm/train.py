"""Training: the configuration, the learning-rate schedule, one truncated-BPTT step, evaluation, the loop.

Truncated backpropagation through time: the text is cut into ``batch`` parallel streams,
read ``bptt`` characters at a time; the recurrent state is carried from one chunk to the
next but detached between them, so gradients stop at chunk boundaries.

The loop (`train`) checkpoints at every evaluation, at the end, and when ``stop()``
turns true between two steps (the command line sets it on SIGINT / SIGTERM). A checkpoint
holds everything the next step depends on, so ``prepare(..., resume=True)`` followed by
``train`` computes bit for bit what the uninterrupted run computes (same device, backend
and thread count).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

import rnnkit

from ..errors import UserError
from .checkpoint import (BEST_FILE, CHECKPOINT_FILE, CONFIG_FILE, Checkpoint, DirectoryLock, atomic_write,
                         check_fresh_directory, check_same_run, error_reason, read_run_files, remove_stale_temporaries,
                         run_identity, update_run_config, write_run_files)
from .data import Streams, Vocabulary, fingerprint, read_corpus, stdlib_corpus
from .history import CURVE_FILE, LN2, LOG_FILE, History, append_log, rewrite_log
from .model import (CharLM, ModelConfig, build_model, detach, flag, require_int, require_number, state_from_tensors,
                    state_tensors)

SCHEDULES = ("constant", "cosine")
PRECISIONS = ("fp32", "bf16")
DEFAULT_FINAL_LR_FRACTION = 0.1
# how often a run evaluates and how much it reads then: saved in config.json's "settings", not
# part of the run's identity (a resumed run reuses them; --eval-every may change them then)
DEFAULT_SETTINGS = {"eval_every": 100, "eval_chars": 50_000}
IGNORED = -100  # the target of evaluate's padding: cross_entropy's ignore_index


@dataclass(frozen=True)
class TrainConfig:
    """How a run is trained; with ModelConfig and the corpus, this fixes every number of the run.

    ``schedule``: "constant", or "cosine" from ``lr`` down to ``lr * final_lr_fraction`` at
    ``decay_steps`` (then constant). Either starts with ``warmup_steps`` of linear warm-up.
    ``precision``: "fp32", or "bf16" (forward and loss under ``torch.autocast``; weights,
    gradients and optimizer state stay float32).
    """

    seed: int = 0
    bptt: int = 64
    batch: int = 32
    lr: float = 3e-3
    clip: float = 1.0
    schedule: str = "constant"
    warmup_steps: int = 0
    final_lr_fraction: Optional[float] = None  # cosine only
    decay_steps: Optional[int] = None  # cosine only
    precision: str = "fp32"

    def __post_init__(self):
        require_int("seed", self.seed, 0)
        require_int("bptt", self.bptt, 1)
        require_int("batch", self.batch, 1)
        require_number("lr", self.lr, "a positive number", lambda v: v > 0)
        require_number("clip", self.clip, "a non-negative number", lambda v: v >= 0)
        require_int("warmup_steps", self.warmup_steps, 0)
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--schedule: expected one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision: expected one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.schedule == "constant":
            for name in ("final_lr_fraction", "decay_steps"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{flag(name)}: only with --schedule cosine (the schedule is constant)")
        else:
            require_number("final_lr_fraction", self.final_lr_fraction, "a number in [0, 1]", lambda v: 0 <= v <= 1)
            require_int("decay_steps", self.decay_steps, 1)
            if self.decay_steps <= self.warmup_steps:
                raise ValueError(f"--decay-steps: expected more steps than --warmup-steps {self.warmup_steps}, "
                                 f"got {self.decay_steps}")


# the flags whose values are part of a run's identity, with their defaults
TRAIN_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig)}


def learning_rate(config: TrainConfig, step: int) -> float:
    """The learning rate of update number ``step`` (1 for the first): a pure function of the step,
    so a resumed run follows the schedule exactly."""
    if step <= config.warmup_steps:
        return config.lr * step / config.warmup_steps
    if config.schedule == "constant":
        return config.lr
    done = min(1.0, (step - config.warmup_steps) / (config.decay_steps - config.warmup_steps))
    final = config.final_lr_fraction
    return config.lr * (final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * done)))


def autocast(precision: str, device: torch.device):
    """The context forward and loss run in: nothing for fp32, ``torch.autocast`` to bfloat16 for bf16."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)


def check_precision(model: CharLM, precision: str, backend: str) -> None:
    """Run the model once on two characters under the precision's autocast; a UserError if it cannot.

    A backend named with ``--backend`` that cannot run the model raises
    `rnnkit.BackendUnavailableError` here, before training (its modules only find out at the first
    call): ``--backend native`` with ``--precision bf16`` on a CPU without bfloat16 instructions, where
    torch's oneDNN LSTM has no bfloat16 kernel (``auto`` takes the fused backend there). Any other
    failure under a low precision becomes a UserError naming ``--precision``.
    The check runs in eval mode and leaves the random generator as it found it.
    """
    device = next(model.parameters()).device
    try:
        with _in_mode(model, False), _same_random_numbers(device), torch.no_grad(), autocast(precision, device):
            model(torch.zeros(2, 1, dtype=torch.int64, device=device))
    except rnnkit.BackendUnavailableError:
        raise
    except RuntimeError as error:
        if precision == "fp32":
            raise
        reason = str(error).strip().splitlines()[0]
        raise UserError(f"--precision {precision}: the model cannot run under torch.autocast({device.type}, bfloat16) "
                        f"with --backend {backend} here ({type(error).__name__}: {reason}); try --backend fused or "
                        f"--backend reference, or --precision fp32") from None


@contextlib.contextmanager
def _in_mode(model: nn.Module, training: bool):
    """A block run in training or evaluation mode; the model's mode comes back after it."""
    was_training = model.training
    model.train(training)
    try:
        yield
    finally:
        model.train(was_training)


def _same_random_numbers(device: torch.device):
    """A block whose draws from the random generators (CPU, and the device's) are undone after it."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


def check_trains(model: CharLM, precision: str, backend: str) -> None:
    """`check_precision`, then one training-mode forward and backward on two characters (the
    pass training runs, which a backend may refuse where inference runs), leaving the
    gradients, the mode and the random generator as they were; before a run writes any file."""
    check_precision(model, precision, backend)
    device = next(model.parameters()).device
    try:
        with _in_mode(model, True), _same_random_numbers(device):
            with autocast(precision, device):
                logits, _ = model(torch.zeros(2, 1, dtype=torch.int64, device=device))
            logits.float().sum().backward()
    finally:
        model.zero_grad(set_to_none=True)


def make_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=config.lr)


def train_step(model, optimizer, x, y, state, clip: float, precision: str = "fp32"):
    """One truncated-BPTT step on chunk (x, y) -> (mean loss in nats, detached state)."""
    model.train()
    with autocast(precision, x.device):
        logits, state = model(x, state)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if clip:
        nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    return loss.item(), detach(state)


def evaluate(model: CharLM, ids: torch.Tensor, batch: int, bptt: int, precision: str = "fp32") -> float:
    """Bits per character of ``ids``: the model predicts every one of ids[1:] from what precedes.

    The text is cut into ``batch`` streams read side by side (fewer where the text is short),
    filled in order; the end of the last is padded, and the padding is not scored.
    """
    device = next(model.parameters()).device
    scored = len(ids) - 1
    batch = max(1, min(batch, scored // bptt))
    length = -(-scored // batch)
    inputs = torch.zeros(batch * length, dtype=ids.dtype)
    targets = torch.full((batch * length,), IGNORED, dtype=ids.dtype)
    inputs[:scored], targets[:scored] = ids[:scored], ids[1:]
    inputs, targets = (t.view(batch, length).t().to(device) for t in (inputs, targets))
    total, state = 0.0, None
    with _in_mode(model, False), torch.no_grad(), autocast(precision, device):
        for start in range(0, length, bptt):
            logits, state = model(inputs[start : start + bptt], state)
            target = targets[start : start + bptt]
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), reduction="sum",
                                     ignore_index=IGNORED).item()
    return total / scored / LN2


@dataclass
class SavedRun:
    """A run directory's config.json and vocab.json, checked (`read_run`)."""

    model: ModelConfig
    training: TrainConfig
    corpus: dict  # source ("stdlib" or a path), sha256, chars, ...
    settings: dict  # DEFAULT_SETTINGS's keys
    vocabulary: Vocabulary
    identity: dict  # checkpoint.run_identity: what its checkpoints must have been written by

    def corpus_text(self, text: Optional[str] = None) -> str:
        """The corpus the run was trained on: ``text`` (a path the user gave) or the one config.json
        names; a UserError if it is not that corpus (its fingerprint differs)."""
        source = self.corpus["source"]
        if text is not None:
            corpus, where = read_corpus(text), f"--text {text}"
        elif source == "stdlib":
            corpus, where = stdlib_corpus(), "the standard library"
        else:
            where = f"{source} (the corpus config.json names)"
            corpus = read_corpus(source, label=where)
        if fingerprint(corpus) != self.corpus["sha256"]:
            raise UserError(f"{where}: not the corpus this run was trained on (its SHA-256 differs from config.json's)")
        return corpus


def read_run(directory: Path) -> SavedRun:
    """config.json and vocab.json of a run, every value checked; a one-line UserError naming the file otherwise."""
    directory = Path(directory)
    model_config, config, vocabulary = read_run_files(directory)
    try:
        training = TrainConfig(**config["training"])
        settings = {**DEFAULT_SETTINGS, **config["settings"]}
        for name, value in settings.items():
            if name not in DEFAULT_SETTINGS:
                raise ValueError(f"unknown setting {name!r} (expected {', '.join(DEFAULT_SETTINGS)})")
            require_int(name, value, 1)
    except (TypeError, ValueError) as error:
        raise UserError(f"{directory / CONFIG_FILE}: not a usable run configuration ({error})") from None
    identity = run_identity(dataclasses.asdict(model_config), dataclasses.asdict(training), config["corpus"]["sha256"],
                            vocabulary.chars)
    return SavedRun(model_config, training, config["corpus"], settings, vocabulary, identity)


# ---- a run -----------------------------------------------------------------------------

@dataclass
class Progress:
    """Where a run stands, beyond weights, optimizer and history: saved in the checkpoint."""

    step: int = 0
    position: int = 0  # the next chunk to read
    elapsed: float = 0.0  # training seconds so far
    interval_loss: float = 0.0  # loss summed since the last evaluation
    interval_steps: int = 0
    interval_seconds: float = 0.0
    best_val_bpc: Optional[float] = None  # the lowest validation bits/char so far (best.safetensors)
    best_step: Optional[int] = None

    def check(self) -> None:
        """A TypeError naming the first field of the wrong kind (a damaged checkpoint's metadata)."""
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            integer = item.name in ("step", "position", "interval_steps", "best_step")
            ok = (value is None and item.name.startswith("best_")) or (
                number and (isinstance(value, int) if integer else True) and value >= 0)
            if not ok:
                raise TypeError(f"progress {item.name}: expected a non-negative {'integer' if integer else 'number'}, "
                                f"got {value!r}")


@dataclass
class Run:
    """A training run ready to go: model, optimizer, data and where it stands."""

    directory: Path
    model: CharLM
    optimizer: torch.optim.Optimizer
    train: Streams
    valid_ids: torch.Tensor
    config: TrainConfig
    device: torch.device
    state: object = None
    progress: Progress = dataclasses.field(default_factory=Progress)
    history: History = dataclasses.field(default_factory=History)
    saved_step: Optional[int] = None  # the step of the checkpoint on disk
    identity: Optional[dict] = None  # checkpoint.run_identity of the run; saved in every checkpoint
    removed_temporaries: List[str] = dataclasses.field(default_factory=list)
    lock: Optional[DirectoryLock] = None  # held while the run may write its directory

    def close(self) -> None:
        """Release the directory for another process (the run writes nothing more)."""
        if self.lock is not None:
            self.lock.release()


def prepare(directory: Path, model_config: ModelConfig, train_config: TrainConfig, vocabulary: Vocabulary,
            train_text: str, valid_text: str, corpus: dict, backend: str = "auto", device="cpu",
            resume: bool = False, settings: Optional[dict] = None, steps: Optional[int] = None) -> Run:
    """Build the model and data; restore the checkpoint when resuming, else write config and vocabulary.

    Nothing is written until the model has run once forward and backward. Then the directory
    is locked for this process (`DirectoryLock`, released by `Run.close` or at exit) and
    temporaries that killed writes left there are removed. When resuming, log.jsonl is
    rewritten from the checkpoint's history, and config.json takes ``corpus`` and ``settings``
    where they changed (the corpus's path, when it moved; the evaluation interval), unless the
    checkpoint is already at ``steps``: a run with nothing to do changes nothing.
    """
    directory, device = Path(directory), torch.device(device)
    if not resume:
        check_fresh_directory(directory)
    torch.manual_seed(train_config.seed)
    model = build_model(model_config, backend).to(device)
    check_trains(model, train_config.precision, backend)
    optimizer = make_optimizer(model, train_config)
    streams = Streams(vocabulary.encode(train_text), train_config.batch, train_config.bptt)
    valid_ids = vocabulary.encode(valid_text)
    if len(valid_ids) < 2:
        raise UserError("the validation text is too short; use a longer --text")
    identity = run_identity(dataclasses.asdict(model_config), dataclasses.asdict(train_config), corpus["sha256"],
                            vocabulary.chars)
    lock = DirectoryLock(directory).acquire()
    try:
        if not resume:
            check_fresh_directory(directory)  # again, now that no other run can be writing there
        removed = remove_stale_temporaries(directory, locked=lock.held)
        run = Run(directory, model, optimizer, streams, valid_ids, train_config, device, identity=identity,
                  removed_temporaries=removed, lock=lock)
        if resume:
            _restore(run, Checkpoint.read(directory / CHECKPOINT_FILE))
            if steps is None or run.progress.step < steps:
                update_run_config(directory, corpus=corpus, settings=settings or {})
                rewrite_log(directory, run.history)
        else:
            write_run_files(directory, {
                "model": dataclasses.asdict(model_config),
                "training": dataclasses.asdict(train_config),
                "corpus": corpus,
                "settings": settings or {},
                "rnnkit": rnnkit.__version__,
                "torch": torch.__version__,
            }, vocabulary)
            for name in (LOG_FILE, CURVE_FILE):  # left by a run that never reached a checkpoint
                (directory / name).unlink(missing_ok=True)
    except BaseException:
        lock.release()
        raise
    return run


def _restore(run: Run, checkpoint: Checkpoint) -> None:
    path = run.directory / CHECKPOINT_FILE
    check_same_run(path, checkpoint, run.identity)
    try:
        expected = _state_shapes(run)
        if checkpoint.state and [tuple(t.shape) for t in checkpoint.state] != expected:
            raise ValueError(f"its carried state has shapes {[tuple(t.shape) for t in checkpoint.state]}, this run's "
                             f"(--batch {run.config.batch}) {expected}")
        run.model.load_state_dict(checkpoint.model, strict=True)
        run.optimizer.load_state_dict(checkpoint.optimizer)
        run.progress = Progress(**checkpoint.progress)
        run.progress.check()
        if run.progress.position >= run.train.chunks:  # kept modulo the chunks: an edited or foreign value
            raise ValueError(f"progress position {run.progress.position}: expected a chunk of the corpus's "
                             f"{run.train.chunks} (--batch {run.config.batch}, --bptt {run.config.bptt})")
        run.history = History.from_checkpoint(checkpoint.history, checkpoint.evaluations, run.progress.step)
        torch.set_rng_state(checkpoint.rng["torch"])
        if run.device.type == "cuda" and "cuda" in checkpoint.rng:
            torch.cuda.set_rng_state(checkpoint.rng["cuda"], run.device)
    except (RuntimeError, KeyError, ValueError, TypeError, AttributeError) as error:
        raise UserError(f"{path}: damaged, or not this run's ({error_reason(error)})") from None
    run.state = state_from_tensors([t.to(run.device) for t in checkpoint.state])
    run.saved_step = run.progress.step


def _state_shapes(run: Run) -> List[tuple]:
    """The shapes of the state the run carries between chunks (one step of the model tells them)."""
    with _in_mode(run.model, False), _same_random_numbers(run.device), torch.no_grad():
        _, state = run.model(torch.zeros(1, run.config.batch, dtype=torch.int64, device=run.device))
    return [tuple(t.shape) for t in state_tensors(state)]


def save(run: Run, best: bool = False) -> None:
    """Checkpoint the run as it stands (and as best.safetensors too when ``best``), atomically.

    best.safetensors is written first: a kill between the two writes leaves a best that a
    resumed run recomputes bit for bit, never a best older than the latest says.
    """
    rng = {"torch": torch.get_rng_state()}
    if run.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(run.device)
    data = Checkpoint(
        model=run.model.state_dict(),
        optimizer=run.optimizer.state_dict(),
        state=state_tensors(run.state),
        rng=rng,
        progress=dataclasses.asdict(run.progress),
        history=run.history.tensors(),
        evaluations=run.history.evaluations,
        run=run.identity,
    ).encode()
    if best:
        atomic_write(run.directory / BEST_FILE, data)
    atomic_write(run.directory / CHECKPOINT_FILE, data)
    run.saved_step = run.progress.step


def train(run: Run, steps: int, eval_every: int, eval_chars: int,
          on_step: Callable[[dict], None] = lambda info: None,
          on_eval: Callable[[dict], None] = lambda record: None,
          stop: Callable[[], bool] = lambda: False) -> bool:
    """Train until ``steps``, evaluating and checkpointing every ``eval_every`` steps and at the end.

    ``stop()`` is asked before every step; when it says True the run is checkpointed where it
    stands and train returns False. Returns True when ``steps`` is reached.
    ``on_step(info)`` after each step: the step's log record plus ``interval_bpc`` (mean
    training bits/char since the last evaluation, over ``interval_steps`` steps) and
    ``chars_per_sec``. ``on_eval(record)`` after each evaluation, with the record in log.jsonl.
    """
    model, optimizer, config, progress, history = run.model, run.optimizer, run.config, run.progress, run.history
    chars_per_step = config.batch * config.bptt
    valid_ids = run.valid_ids[: eval_chars + 1]
    while progress.step < steps:
        if stop():
            if run.saved_step != progress.step:
                save(run)
            return False
        started = time.perf_counter()
        if progress.position % run.train.chunks == 0:
            run.state = None  # a new epoch starts each stream from the beginning of its slice
        x, y = (t.to(run.device) for t in run.train.chunk(progress.position))
        lr = learning_rate(config, progress.step + 1)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss, run.state = train_step(model, optimizer, x, y, run.state, config.clip, config.precision)
        if not math.isfinite(loss):
            raise UserError(f"the loss became {loss} at step {progress.step + 1}; start again with a smaller --lr "
                            "in another --out (--resume keeps a run's --lr)")
        seconds = time.perf_counter() - started
        progress.step += 1
        progress.position = (progress.position + 1) % run.train.chunks
        progress.elapsed += seconds
        progress.interval_loss += loss
        progress.interval_steps += 1
        progress.interval_seconds += seconds
        record = history.add_step(loss, lr)
        append_log(run.directory, [record])
        on_step({**record, "interval_bpc": progress.interval_loss / progress.interval_steps / LN2,
                 "interval_steps": progress.interval_steps, "chars_per_sec": chars_per_step / max(seconds, 1e-9)})
        if progress.step % eval_every == 0 or progress.step == steps:
            val_bpc = evaluate(model, valid_ids, config.batch, config.bptt, config.precision)
            if not math.isfinite(val_bpc):  # never a best, nor a log line strict JSON refuses
                raise UserError(f"the validation bits/char became {val_bpc} at step {progress.step} (the training loss "
                                f"was finite: its outputs overflow on the longer validation text); start again with a "
                                "smaller --lr in another --out (--resume keeps a run's --lr)")
            improved = progress.best_val_bpc is None or val_bpc < progress.best_val_bpc
            train_loss = progress.interval_loss / progress.interval_steps
            record = {
                "kind": "eval",
                "step": progress.step,
                "val_bpc": val_bpc,
                "train_bpc": train_loss / LN2,
                "train_loss": train_loss,
                "train_steps": progress.interval_steps,
                "lr": lr,
                "best": improved,
                "chars_per_sec": chars_per_step * progress.interval_steps / max(progress.interval_seconds, 1e-9),
                "elapsed_s": progress.elapsed,
            }
            history.evaluations.append(record)
            if progress.step % eval_every == 0:  # the end of a run does not end an interval, so resuming keeps them
                progress.interval_loss, progress.interval_steps, progress.interval_seconds = 0.0, 0, 0.0
            if improved:
                progress.best_val_bpc, progress.best_step = val_bpc, progress.step
            save(run, best=improved)
            append_log(run.directory, [record])  # after the checkpoint: a lost line is rebuilt on resume
            on_eval(record)
    return True
