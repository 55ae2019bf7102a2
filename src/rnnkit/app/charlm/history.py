"""What a run has done so far: per-step training losses and evaluations, log.jsonl and the curve.

The history is part of every checkpoint, so ``log.jsonl`` can always be rebuilt from the
checkpoint: a resumed run rewrites it to match (dropping lines of steps the checkpoint never
reached, restoring an evaluation whose line was lost when the process was killed between the
checkpoint's rename and the log's append), then appends as it goes.

``log.jsonl``, one JSON object per line, in step order:

    {"kind": "train", "step": 7, "loss": 3.91, "bpc": 5.64, "lr": 0.003}
    {"kind": "eval", "step": 100, "val_bpc": 2.94, "train_bpc": 3.63, "train_loss": 2.52,
     "train_steps": 100, "lr": 0.003, "best": true, "chars_per_sec": 17251.0, "elapsed_s": 11.9}

``train_bpc`` of an evaluation is the mean training bits/char of the steps since the previous
evaluation (``train_steps`` of them): the number the progress bar shows.
"""
from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from .checkpoint import atomic_write

LOG_FILE, CURVE_FILE = "log.jsonl", "curve.png"
LN2 = math.log(2)
TRAINING_LABEL, VALIDATION_LABEL = "training (each step)", "validation"


@dataclass
class History:
    """``losses[k - 1]`` and ``lrs[k - 1]``: training loss (nats) and learning rate of step k; the evaluations."""

    losses: List[float] = field(default_factory=list)
    lrs: List[float] = field(default_factory=list)
    evaluations: List[dict] = field(default_factory=list)

    def add_step(self, loss: float, lr: float) -> dict:
        """Record the next step -> its log record."""
        self.losses.append(loss)
        self.lrs.append(lr)
        return self.step_record(len(self.losses))

    def step_record(self, step: int) -> dict:
        loss = self.losses[step - 1]
        return {"kind": "train", "step": step, "loss": loss, "bpc": loss / LN2, "lr": self.lrs[step - 1]}

    def records(self) -> List[dict]:
        """Every log record, in the order the run wrote them."""
        by_step: Dict[int, List[dict]] = {}
        for record in self.evaluations:
            by_step.setdefault(record["step"], []).append(record)
        out = []
        for step in range(1, len(self.losses) + 1):
            out.append(self.step_record(step))
            out += by_step.get(step, [])
        return out

    def tensors(self) -> Dict[str, torch.Tensor]:
        """The per-step series, for the checkpoint (float64 holds the Python floats exactly)."""
        return {"loss": torch.tensor(self.losses, dtype=torch.float64), "lr": torch.tensor(self.lrs, dtype=torch.float64)}

    @classmethod
    def from_checkpoint(cls, tensors: Dict[str, torch.Tensor], evaluations: List[dict], steps: int) -> "History":
        history = cls(tensors["loss"].tolist(), tensors["lr"].tolist(), list(evaluations))
        if len(history.losses) != steps or len(history.lrs) != steps:
            raise ValueError(f"the history has {len(history.losses)} steps, the checkpoint is at step {steps}")
        return history

    def curve(self) -> Dict[str, Tuple[List[int], List[float]]]:
        """The learning curve's series: per-step training bits/char, validation bits/char at each evaluation."""
        steps = list(range(1, len(self.losses) + 1))
        return {
            TRAINING_LABEL: (steps, [loss / LN2 for loss in self.losses]),
            VALIDATION_LABEL: ([r["step"] for r in self.evaluations], [r["val_bpc"] for r in self.evaluations]),
        }


# ---- log.jsonl -------------------------------------------------------------------------

def _line(record: dict) -> str:
    return json.dumps(record) + "\n"


def append_log(directory: Path, records: List[dict]) -> None:
    """Append records to log.jsonl (not atomic: a line cut by a crash is dropped by `read_log`
    and rebuilt from the checkpoint on resume)."""
    with open(Path(directory) / LOG_FILE, "a", encoding="utf-8") as file:
        file.write("".join(_line(r) for r in records))


def rewrite_log(directory: Path, history: History) -> bool:
    """Make log.jsonl say exactly what ``history`` says (atomically) -> whether it had to change."""
    path = Path(directory) / LOG_FILE
    text = "".join(_line(r) for r in history.records())
    try:
        if path.read_text(encoding="utf-8") == text:
            return False
    except (FileNotFoundError, UnicodeDecodeError):
        pass
    atomic_write(path, text.encode("utf-8"))
    return True


def read_log(directory: Path) -> List[dict]:
    path = Path(directory) / LOG_FILE
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a crash
    return records


# ---- the learning curve ----------------------------------------------------------------

def plot_curve(directory: Path, history: History, title: str = "") -> Tuple[Optional[dict], Optional[str]]:
    """Draw curve.png -> (what was drawn, None), or (None, a one-line note saying why there is no plot).

    What was drawn is read back from the figure: ``{"series": {label: (x, y)}, "xlabel",
    "ylabel", "legend": [labels]}``, so tests check the plotted data rather than pixels.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, "no learning-curve plot: matplotlib is not installed (pip install 'rnnkit[cli]')"
    series = history.curve()
    figure, axes = plt.subplots(figsize=(7, 4.5))
    steps, train_bpc = series[TRAINING_LABEL]
    axes.plot(steps, train_bpc, color="tab:blue", alpha=0.45, linewidth=0.8, label=TRAINING_LABEL)
    steps, valid_bpc = series[VALIDATION_LABEL]
    axes.plot(steps, valid_bpc, color="tab:orange", marker="o", markersize=4, linewidth=1.5, label=VALIDATION_LABEL)
    axes.set_xlabel("step")
    axes.set_ylabel("bits per character")
    if title:
        axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3)
    legend = axes.legend()
    figure.tight_layout()
    drawn = {
        "series": {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in axes.get_lines()},
        "xlabel": axes.get_xlabel(),
        "ylabel": axes.get_ylabel(),
        "legend": [text.get_text() for text in legend.get_texts()],
    }
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    plt.close(figure)
    atomic_write(Path(directory) / CURVE_FILE, buffer.getvalue())
    return drawn, None
