"""The text a character model reads: the corpus, its vocabulary, the validation split, parallel streams."""
from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path
from typing import Sequence, Tuple

import torch

from ..errors import UserError

DEFAULT_CORPUS_CHARS = 1_000_000  # the stdlib corpus: this many characters of sorted *.py files
VALID_FRACTION = 0.05  # the tail of every block held out for validation


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


def read_corpus(path: str, label: str = "") -> str:
    """A UTF-8 text file, or a one-line UserError saying what is wrong with it.

    ``label`` names where the path came from in the error (default: the ``--text`` flag); a
    missing file named by a run's config.json says how to point at its new place.
    """
    file = Path(path)
    where = label or f"--text {path}"
    if not file.exists():
        moved = "; if it moved, pass its new path with --text" if label else ""
        raise UserError(f"{where}: no such file{moved}")
    if not file.is_file():
        raise UserError(f"{where}: not a regular file")
    try:
        data = file.read_bytes()
    except OSError as error:
        raise UserError(f"{where}: cannot read it ({error.strerror})") from None
    if not data.strip():
        raise UserError(f"{where}: the file is empty" if not data else
                        f"{where}: the file holds only whitespace ({len(data):,} bytes)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UserError(f"{where}: not UTF-8 text (invalid byte at offset {error.start})") from None


def fingerprint(text: str) -> str:
    """SHA-256 of the text: a resumed run must read the corpus it was trained on."""
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
