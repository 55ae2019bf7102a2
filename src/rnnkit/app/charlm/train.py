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
from .checkpoint import BEST_FILE, CHECKPOINT_FILE, Checkpoint, atomic_write, remove_stale_temporaries, write_run_files
from .data import Streams, Vocabulary
from .history import CURVE_FILE, LN2, LOG_FILE, History, append_log, rewrite_log
from .model import CharLM, ModelConfig, build_model, detach, state_from_tensors, state_tensors

SCHEDULES = ("constant", "cosine")
PRECISIONS = ("fp32", "bf16")
DEFAULT_FINAL_LR_FRACTION = 0.1


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
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--schedule: expected one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision: expected one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.schedule == "constant":
            for name in ("final_lr_fraction", "decay_steps"):
                if getattr(self, name) is not None:
                    flag = "--" + name.replace("_", "-")
                    raise ValueError(f"{flag}: only with --schedule cosine (the schedule is constant)")
        else:
            if self.final_lr_fraction is None or not 0.0 <= self.final_lr_fraction <= 1.0:
                raise ValueError(f"--final-lr-fraction: expected a number in [0, 1], got {self.final_lr_fraction}")
            if self.decay_steps is None or self.decay_steps <= self.warmup_steps:
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

    torch's own oneDNN LSTM (rnnkit's ``native`` backend, ``auto``'s choice for plain cells on
    CPU) has no bfloat16 kernel on CPUs without bfloat16 instructions; say so before training.
    The check runs in eval mode and leaves the random generator as it found it.
    """
    if precision == "fp32":
        return
    device = next(model.parameters()).device
    rng = torch.get_rng_state()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast(precision, device):
            model(torch.zeros(2, 1, dtype=torch.int64, device=device))
    except RuntimeError as error:
        reason = str(error).strip().splitlines()[0]
        raise UserError(f"--precision {precision}: the model cannot run under torch.autocast({device.type}, bfloat16) "
                        f"with --backend {backend} here ({type(error).__name__}: {reason}); try --backend fused or "
                        f"--backend reference, or --precision fp32") from None
    finally:
        model.train(was_training)
        torch.set_rng_state(rng)


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
    """Bits per character of ``ids`` (the model predicts ids[1:] from what precedes)."""
    device = next(model.parameters()).device
    batch = max(1, min(batch, (len(ids) - 1) // bptt))
    length = (len(ids) - 1) // batch
    inputs = ids[: batch * length].view(batch, length).t().to(device)
    targets = ids[1 : batch * length + 1].view(batch, length).t().to(device)
    was_training = model.training
    model.eval()
    total, count, state = 0.0, 0, None
    with torch.no_grad(), autocast(precision, device):
        for start in range(0, length, bptt):
            logits, state = model(inputs[start : start + bptt], state)
            target = targets[start : start + bptt]
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), reduction="sum").item()
            count += target.numel()
    model.train(was_training)
    return total / count / LN2


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
    removed_temporaries: List[str] = dataclasses.field(default_factory=list)


def prepare(directory: Path, model_config: ModelConfig, train_config: TrainConfig, vocabulary: Vocabulary,
            train_text: str, valid_text: str, corpus: dict, backend: str = "auto", device="cpu",
            resume: bool = False, settings: Optional[dict] = None) -> Run:
    """Build the model and data; restore the checkpoint when resuming, else write config and vocabulary.

    First removes temporaries that killed writes left in ``directory``. When resuming,
    log.jsonl is rewritten from the checkpoint's history. ``settings`` (e.g. the evaluation
    interval) go into config.json, for a resumed run to reuse.
    """
    directory, device = Path(directory), torch.device(device)
    removed = remove_stale_temporaries(directory)
    torch.manual_seed(train_config.seed)
    model = build_model(model_config, backend).to(device)
    check_precision(model, train_config.precision, backend)
    optimizer = make_optimizer(model, train_config)
    streams = Streams(vocabulary.encode(train_text), train_config.batch, train_config.bptt)
    valid_ids = vocabulary.encode(valid_text)
    if len(valid_ids) < 2:
        raise UserError("the validation text is too short; use a longer --text")
    run = Run(directory, model, optimizer, streams, valid_ids, train_config, device, removed_temporaries=removed)
    if resume:
        _restore(run, Checkpoint.read(directory / CHECKPOINT_FILE))
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
    return run


def _restore(run: Run, checkpoint: Checkpoint) -> None:
    path = run.directory / CHECKPOINT_FILE
    try:
        run.model.load_state_dict(checkpoint.model, strict=True)
        run.optimizer.load_state_dict(checkpoint.optimizer)
        run.progress = Progress(**checkpoint.progress)
        run.history = History.from_checkpoint(checkpoint.history, checkpoint.evaluations, run.progress.step)
        torch.set_rng_state(checkpoint.rng["torch"])
        if run.device.type == "cuda" and "cuda" in checkpoint.rng:
            torch.cuda.set_rng_state(checkpoint.rng["cuda"], run.device)
    except (RuntimeError, KeyError, ValueError, TypeError) as error:
        reason = str(error).strip().splitlines()[0] or type(error).__name__
        raise UserError(f"{path}: does not match config.json ({reason})") from None
    run.state = state_from_tensors([t.to(run.device) for t in checkpoint.state])
    run.saved_step = run.progress.step


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
            raise UserError(f"the loss became {loss} at step {progress.step + 1}; try a smaller --lr")
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
