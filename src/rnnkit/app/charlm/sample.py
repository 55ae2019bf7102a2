"""Generation: continue a prime one character per step, feeding back the carried state."""
from __future__ import annotations

from typing import Iterator, List

import torch

from ..errors import UserError
from .data import Vocabulary
from .model import CharLM
from .train import autocast


def default_prime(vocabulary: Vocabulary) -> str:
    """What generation starts from when no --prime is given: a newline, else a space, where the
    vocabulary has one; a UserError asking for --prime otherwise."""
    for prime in ("\n", " "):
        if prime in vocabulary.index:
            return prime
    raise UserError("the model's vocabulary has neither a newline nor a space to start from; pass --prime")


def sample(model: CharLM, vocabulary: Vocabulary, prime: str, length: int, temperature: float = 1.0,
           seed: int = 0, precision: str = "fp32") -> str:
    """Continue ``prime`` by ``length`` characters, one step at a time with the carried state: the
    text `generate` yields, whole."""
    return "".join(generate(model, vocabulary, prime, length, temperature, seed, precision))


def generate(model: CharLM, vocabulary: Vocabulary, prime: str, length: int, temperature: float = 1.0,
             seed: int = 0, precision: str = "fp32", piece: int = 256) -> Iterator[str]:
    """``prime``, then its continuation by ``length`` characters as they are drawn, in pieces that
    end at each newline or after ``piece`` characters (``rnnkit sample`` prints them as they come).

    The prime runs through the stack in one call; then each new character is fed back as a
    one-step sequence with the state of the previous step. ``temperature`` 0 is greedy.
    The same seed gives the same text (on the same device).
    """
    if not prime:
        raise UserError("--prime: needs at least one character")
    try:
        ids = vocabulary.encode(prime)
    except UserError as error:
        raise UserError(f"--prime: {error}") from None
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    newline = vocabulary.index.get("\n")
    model.eval()
    yield prime
    out: List[int] = []
    with torch.no_grad(), autocast(precision, device):
        logits, state = model(ids.view(-1, 1).to(device))  # [T, 1, V]
        for _ in range(length):
            scores = logits[-1, 0].double().cpu()
            if temperature == 0:
                next_id = int(scores.argmax())
            else:
                # the largest score subtracted first: a tiny temperature sends the rest to -inf, never inf - inf
                probabilities = torch.softmax((scores - scores.max()) / temperature, dim=0)
                next_id = int(torch.multinomial(probabilities, 1, generator=generator))
            out.append(next_id)
            if next_id == newline or len(out) >= piece:
                yield vocabulary.decode(out)
                out = []
            logits, state = model(torch.tensor([[next_id]], device=device), state)
    if out:
        yield vocabulary.decode(out)
