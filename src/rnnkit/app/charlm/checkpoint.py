"""The run directory's files: atomic writes, stale temporaries, config and vocabulary, checkpoints.

    config.json              model and training configuration, corpus fingerprint, settings
    vocab.json               the characters, in id order
    checkpoint.safetensors   the latest checkpoint (see `Checkpoint`)
    best.safetensors         the checkpoint with the lowest validation bits/char so far
    log.jsonl, curve.png     written by history.py

Every file is written to a temporary name beside it (``.NAME.tmp-PID``), flushed to disk and
moved into place with ``os.replace``, so a reader sees the old file or the new one, never
half of one. A write killed before the rename leaves its temporary behind;
`remove_stale_temporaries` removes those on the next start. Nothing is unpickled:
checkpoints are safetensors (tensors) with JSON metadata, and the SHA-256 of their tensors, which
reading checks (safetensors checks the header, not the values: flipped bytes in the data loaded).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from ..errors import UserError
from ..files import atomic_write
from .data import Vocabulary
from .model import ModelConfig, flag

FORMAT = "rnnkit-charlm/2"
CONFIG_FILE, VOCAB_FILE = "config.json", "vocab.json"
CHECKPOINT_FILE, BEST_FILE = "checkpoint.safetensors", "best.safetensors"
# the files a run writes beside its checkpoints (history.py names the last two)
RUN_FILES = (CONFIG_FILE, VOCAB_FILE, "log.jsonl", "curve.png")
WRITTEN_FILES = RUN_FILES + (CHECKPOINT_FILE, BEST_FILE)  # every file a run writes in its directory

_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)$")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_stale_temporaries(directory: Path, locked: bool = False) -> List[str]:
    """Remove the temporaries of writes that were killed before their rename -> their names.

    Called when a run starts, before this process writes anything: a temporary
    ``.NAME.tmp-PID`` of one of a run's files (NAME in `WRITTEN_FILES`) is stale when this
    process holds the directory's lock (``locked``: only a training run writes those files, and
    no other can be running there), else when PID is this process or no longer running (a PID
    alone misleads where PIDs are reused, as in containers: a killed write's temporary stayed). One
    of another live process is left alone without the lock, and every other file always (a
    user's own ``.x.tmp-123`` included).
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for path in sorted(directory.iterdir()):
        match = _TEMPORARY.match(path.name)
        if not match or match["name"] not in WRITTEN_FILES or not path.is_file():
            continue
        pid = int(match["pid"])
        if locked or pid == os.getpid() or not _running(pid):
            path.unlink()
            removed.append(path.name)
    return removed


def write_json(path: Path, value) -> None:
    atomic_write(path, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def read_json(path: Path, what: str):
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: missing ({what})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"{path}: unreadable {what} ({type(error).__name__}: {error})".splitlines()[0]) from None


def write_run_files(directory: Path, config: dict, vocabulary: Vocabulary) -> None:
    """config.json (``format`` is added) and vocab.json of a new run."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    write_json(directory / CONFIG_FILE, {"format": FORMAT, **config})
    write_json(directory / VOCAB_FILE, vocabulary.chars)


def update_run_config(directory: Path, **sections) -> None:
    """Replace sections of an existing config.json (atomically, and only where they differ)."""
    path = Path(directory) / CONFIG_FILE
    config = read_json(path, "run configuration")
    updated = {**config, **json.loads(json.dumps(sections))}
    if updated != config:
        write_json(path, updated)


def read_run_files(directory: Path) -> Tuple[ModelConfig, dict, Vocabulary]:
    """Read config.json and vocab.json -> (ModelConfig, the whole config, Vocabulary).

    Checks what every reader needs: the format, the sections (``model``, ``training``,
    ``corpus``, ``settings``) and their kinds, the model configuration, the vocabulary against
    ``vocab_size``; a UserError naming the file otherwise. `train.read_run` checks the rest.
    """
    directory = Path(directory)
    config_path, vocab_path = directory / CONFIG_FILE, directory / VOCAB_FILE
    config = read_json(config_path, "run configuration")
    chars = read_json(vocab_path, "vocabulary")
    try:
        if not isinstance(config, dict):
            raise ValueError(f"expected a JSON object, got {type(config).__name__}")
        if config.get("format") != FORMAT:
            raise ValueError(f"format {config.get('format')!r}, this rnnkit reads {FORMAT!r}")
        for section in ("model", "training", "corpus", "settings"):
            if not isinstance(config.get(section), dict):
                raise ValueError(f"{section!r}: expected a JSON object, got {json.dumps(config.get(section))}")
        for key in ("source", "sha256"):
            if not isinstance(config["corpus"].get(key), str):
                raise ValueError(f"corpus {key!r}: expected a string, got {json.dumps(config['corpus'].get(key))}")
        model = ModelConfig(**config["model"])
    except (TypeError, ValueError) as error:
        raise UserError(f"{config_path}: not a usable run configuration ({error})") from None
    if not isinstance(chars, list) or not all(isinstance(c, str) and len(c) == 1 for c in chars) \
            or len(set(chars)) != len(chars):
        raise UserError(f"{vocab_path}: not a usable vocabulary (expected a JSON list of distinct characters)")
    if len(chars) != model.vocab_size:
        raise UserError(f"{vocab_path}: {len(chars)} characters, but {config_path} says vocab_size {model.vocab_size}")
    return model, config, Vocabulary(chars)


def check_fresh_directory(directory: Path) -> None:
    """A UserError unless a new run may write into ``directory``: it may not exist yet, or hold
    other files, or the files of an rnnkit run that never reached a checkpoint (which the new
    run replaces). A checkpoint there (continue it with --resume), a log.jsonl with evaluations
    (a run whose checkpoints were deleted), or a config.json, vocab.json, log.jsonl or curve.png
    not written by an rnnkit run, is never overwritten."""
    directory = Path(directory)
    if directory.is_symlink() and not directory.exists():
        raise UserError(f"--out {directory}: a symbolic link to {os.readlink(directory)}, which does not exist")
    if directory.exists() and not directory.is_dir():
        raise UserError(f"--out {directory}: not a directory")
    for name in (CHECKPOINT_FILE, BEST_FILE):
        if (directory / name).exists():
            raise UserError(f"{directory} already holds {name}; pass --resume to continue that run, or choose another --out")
    ours = [name for name in RUN_FILES if (directory / name).exists()]
    if not ours:
        return
    try:
        config = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
        written_by_a_run = isinstance(config, dict) and config.get("format") == FORMAT
    except (OSError, UnicodeDecodeError, ValueError):
        written_by_a_run = False
    if not written_by_a_run:
        raise UserError(f"--out {directory}: it holds {', '.join(ours)} that no rnnkit run wrote, and a run writes "
                        f"{', '.join(RUN_FILES)} there; choose another --out")
    evaluated = _evaluated_steps(directory / "log.jsonl")
    if evaluated:  # the run did checkpoint; its checkpoints were removed, its log is all that is left
        raise UserError(f"--out {directory}: it holds the log of a run that was evaluated and checkpointed at step "
                        f"{max(evaluated)} (its checkpoints are gone); choose another --out")


def _evaluated_steps(log: Path) -> List[int]:
    """The steps of the evaluation records in a log.jsonl (none if it is missing or unreadable)."""
    try:
        lines = log.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    steps = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("kind") == "eval" and isinstance(record.get("step"), int):
            steps.append(record["step"])
    return steps


class DirectoryLock:
    """An exclusive lock on a run directory while a process trains in it (``flock`` on the
    directory itself: no file of its own, released when the process ends, however it ends): a
    second ``rnnkit train`` in the same directory is refused instead of interleaving its
    checkpoints and log with the first's. Where ``fcntl`` is missing (Windows) it locks nothing."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._descriptor = None

    def acquire(self) -> "DirectoryLock":
        try:
            import fcntl
        except ImportError:
            return self
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise UserError(f"--out {self.directory}: cannot create the directory ({error.strerror or error})") from None
        descriptor = os.open(self.directory, os.O_RDONLY)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(descriptor)
            raise UserError(f"--out {self.directory}: another rnnkit train is running in it; wait for it to end, "
                            f"or choose another --out") from None
        self._descriptor = descriptor
        return self

    @property
    def held(self) -> bool:
        """Whether this process holds the lock (False where nothing can be locked)."""
        return self._descriptor is not None

    def release(self) -> None:
        if self._descriptor is not None:
            os.close(self._descriptor)  # closing the descriptor releases the flock
            self._descriptor = None

    def __del__(self):
        self.release()


def error_reason(error: Exception) -> str:
    """One line of an exception's message that says what is wrong: load_state_dict's first line
    is a heading ("Error(s) in loading state_dict for ..."), so its first detail instead."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("Error(s) in loading state_dict"):
        return lines[1]
    return lines[0] if lines else type(error).__name__


def run_identity(model: dict, training: dict, corpus_sha256: str, vocabulary: List[str]) -> dict:
    """What makes two checkpoints parts of the same run: the model and training configurations,
    the corpus's fingerprint and the vocabulary (the character of each id), as config.json and
    vocab.json hold them (a JSON round trip, so that a dataclass's values and the file's compare equal)."""
    return json.loads(json.dumps({"model": model, "training": training, "corpus": corpus_sha256,
                                  "vocabulary": "".join(vocabulary)}))


def check_same_run(path: Path, checkpoint: "Checkpoint", identity: dict) -> None:
    """A UserError unless the checkpoint at ``path`` was written by the run ``identity`` describes
    (the run files beside it): a checkpoint copied in from another run, or run files edited
    since, must not continue, sample or score as this run. Checkpoints from before the
    identity was recorded pass unchecked."""
    theirs = checkpoint.run
    if theirs is None:
        return
    config = Path(path).parent / CONFIG_FILE
    again = "keep a run's files together, as rnnkit train wrote them"
    if theirs.get("corpus") != identity["corpus"]:
        raise UserError(f"{path} belongs to another run: it was trained on another corpus than {config} names; {again}")
    if theirs.get("vocabulary") != identity["vocabulary"]:
        raise UserError(f"{path} belongs to another run: its characters are not those of "
                        f"{Path(path).parent / VOCAB_FILE} (in that order); {again}")
    for section in ("model", "training"):
        mine, other = identity[section], theirs.get(section) or {}
        for key in sorted(set(mine) | set(other)):
            if mine.get(key) != other.get(key):
                name = key if key == "vocab_size" else flag(key)
                raise UserError(f"{path} belongs to another run: {name} is {json.dumps(other.get(key))} there, "
                                f"{json.dumps(mine.get(key))} in {config}; {again}")


def require_safetensors():
    """The safetensors.torch module, or a UserError saying how to install it."""
    try:
        import safetensors.torch
    except ImportError:
        raise UserError("checkpoints need the safetensors package: pip install 'rnnkit[cli]'") from None
    return safetensors.torch


# ---- checkpoints -----------------------------------------------------------------------

@dataclass
class Checkpoint:
    """Everything a run needs to continue exactly; one safetensors file.

    Tensors: ``model.*`` (the state_dict, torch.nn names), ``optimizer.<index>.<key>``,
    ``state.<k>`` (the carried state), ``rng.torch`` / ``rng.cuda`` (generator states),
    ``history.<name>`` (per-step series). Metadata (JSON strings): ``format``, ``progress``,
    ``param_groups`` (the optimizer's), ``evaluations`` (the evaluation records), ``run``
    (the run's identity, `run_identity`: a checkpoint is only read beside its own config.json).
    """

    model: Dict[str, torch.Tensor]
    optimizer: dict
    state: List[torch.Tensor] = field(default_factory=list)
    rng: Dict[str, torch.Tensor] = field(default_factory=dict)
    progress: dict = field(default_factory=dict)
    history: Dict[str, torch.Tensor] = field(default_factory=dict)
    evaluations: List[dict] = field(default_factory=list)
    run: Optional[dict] = None  # the run's identity (`run_identity`); None in checkpoints older than it

    def encode(self) -> bytes:
        st = require_safetensors()
        # clone: state_dict entries are views of one packed buffer, and safetensors refuses shared storage
        tensors = {f"model.{k}": _plain(v) for k, v in self.model.items()}
        for index, entry in self.optimizer["state"].items():
            for key, value in entry.items():
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"optimizer state {key!r} is not a tensor; cannot store it")
                tensors[f"optimizer.{index}.{key}"] = _plain(value)
        tensors.update({f"state.{k}": _plain(t) for k, t in enumerate(self.state)})
        tensors.update({f"rng.{k}": _plain(t) for k, t in self.rng.items()})
        tensors.update({f"history.{k}": _plain(t) for k, t in self.history.items()})
        metadata = {
            "format": FORMAT,
            "progress": json.dumps(self.progress),
            "param_groups": json.dumps(self.optimizer["param_groups"]),
            "evaluations": json.dumps(self.evaluations),
        }
        if self.run is not None:
            metadata["run"] = json.dumps(self.run)
        metadata["sha256"] = _digest(tensors)
        return st.save(tensors, metadata=metadata)

    @classmethod
    def read(cls, path: Path) -> "Checkpoint":
        """Load and validate a checkpoint file, or raise a one-line UserError saying what is wrong."""
        tensors, metadata = _read_safetensors(Path(path))
        if "sha256" in metadata and metadata["sha256"] != _digest(tensors):  # files before it have none
            raise UserError(f"{path}: damaged checkpoint (its tensors' SHA-256 differs from the one written with "
                            "them)")
        for key, value in tensors.items():
            if key.startswith("model.") and value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise UserError(f"{path}: damaged checkpoint ({key} holds NaN or infinite values)")
        try:
            entries: Dict[int, Dict[str, torch.Tensor]] = {}
            parts: Dict[str, Dict[str, torch.Tensor]] = {"model": {}, "state": {}, "rng": {}, "history": {}}
            for key, value in tensors.items():
                kind, _, name = key.partition(".")
                if kind == "optimizer":
                    index, _, name = name.partition(".")
                    entries.setdefault(int(index), {})[name] = value
                else:
                    parts[kind][name] = value
            state = [parts["state"][str(k)] for k in range(len(parts["state"]))]
            kinds = {"progress": dict, "param_groups": list, "evaluations": list, "run": dict}  # "run": newer files only
            meta = {name: json.loads(metadata[name]) for name in kinds if name != "run" or name in metadata}
            for name, value in meta.items():
                if not isinstance(value, kinds[name]):
                    raise TypeError(f"{name}: expected a JSON {'object' if kinds[name] is dict else 'list'}")
            if not all(isinstance(r, dict) and isinstance(r.get("step"), int) and isinstance(r.get("val_bpc"), float)
                       for r in meta["evaluations"]):
                raise TypeError("evaluations: expected records with a step and a val_bpc")
            return cls(
                model=parts["model"],
                optimizer={"state": entries, "param_groups": meta["param_groups"]},
                state=state,
                rng=parts["rng"],
                progress=meta["progress"],
                history=parts["history"],
                evaluations=meta["evaluations"],
                run=meta.get("run"),
            )
        except (KeyError, ValueError, TypeError) as error:
            raise UserError(f"{path}: damaged checkpoint ({type(error).__name__}: {error})".splitlines()[0]) from None


def _digest(tensors: Dict[str, torch.Tensor]) -> str:
    """SHA-256 of the tensors (CPU tensors, as written and as read: name, dtype, shape and bytes of
    each, in name order), hex; the bytes are hashed in place."""
    digest = hashlib.sha256()
    for key in sorted(tensors):
        tensor = tensors[key]
        digest.update(f"{key}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True).contiguous()


def _read_safetensors(path: Path) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    st = require_safetensors()
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{path}: no checkpoint there") from None
    except OSError as error:
        raise UserError(f"{path}: cannot read it ({error.strerror})") from None
    try:
        tensors = st.load(data)
        # safetensors' layout: 8-byte little-endian header size, then the JSON header with __metadata__
        header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
        metadata = header.get("__metadata__") or {}
    except Exception as error:  # safetensors raises its own error types for damaged files
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UserError(f"{path}: corrupted or truncated checkpoint ({reason})") from None
    if metadata.get("format") != FORMAT:
        found = metadata.get("format")
        why = "written by another version of rnnkit" if str(found).startswith("rnnkit-charlm/") else "not an rnnkit character-model checkpoint"
        raise UserError(f"{path}: {why} (format {found!r}, this rnnkit reads {FORMAT!r})")
    return tensors, metadata
