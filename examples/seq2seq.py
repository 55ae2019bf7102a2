"""Encoder-decoder with rnnkit: learn to reverse strings of digits.

The encoder (rnnkit.LSTM with ``lengths``) reads a digit string; its final (h, c) is the
decoder's initial state. The decoder is trained with teacher forcing over the whole
target at once, and decodes greedily one step at a time: the same rnnkit.LSTM module is
called with T=1 and the carried state, feeding back its own previous prediction.

    python examples/seq2seq.py                   # full run: >= 99% exact-sequence accuracy
    python examples/seq2seq.py --steps 200       # a short run

Tokens: digits 0-9, and 10 which is both the decoder's start symbol and the end symbol.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import rnnkit

END = 10  # start-of-decoding and end-of-sequence token
VOCAB = 11


def make_batch(batch: int, max_len: int, generator: torch.Generator):
    """-> (source [S, B], lengths [B], decoder input [S+1, B], target [S+1, B] with -100 as padding)."""
    lengths = torch.randint(1, max_len + 1, (batch,), generator=generator)
    digits = torch.randint(0, 10, (max_len, batch), generator=generator)
    steps = torch.arange(max_len).unsqueeze(1)  # [S, 1]
    source = torch.where(steps < lengths, digits, END)
    reversed_digits = torch.stack([torch.cat([digits[:n, b].flip(0), digits[n:, b]]) for b, n in enumerate(lengths.tolist())], 1)
    target = torch.full((max_len + 1, batch), -100)
    target[:max_len] = torch.where(steps < lengths, reversed_digits, -100)
    target[lengths, torch.arange(batch)] = END
    decoder_input = torch.cat([torch.full((1, batch), END), target[:-1].clamp(min=0)])
    return source, lengths, decoder_input, target


class Seq2Seq(nn.Module):
    def __init__(self, hidden: int = 128, embedding: int = 32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, embedding)
        self.encoder = rnnkit.LSTM(embedding, hidden)
        self.decoder = rnnkit.LSTM(embedding, hidden)
        self.out = nn.Linear(hidden, VOCAB)

    def encode(self, source, lengths):
        _, state = self.encoder(self.embed(source), lengths=lengths)  # the state after each string's last digit
        return state

    def forward(self, source, lengths, decoder_input):
        """Teacher forcing: logits [S+1, B, VOCAB] for every target position."""
        y, _ = self.decoder(self.embed(decoder_input), self.encode(source, lengths))
        return self.out(y)

    @torch.no_grad()
    def greedy(self, source, lengths, max_steps: int):
        """Decode one step at a time from the encoder's state -> tokens [max_steps, B]."""
        state = self.encode(source, lengths)
        token = torch.full((1, source.shape[1]), END)
        outputs = []
        for _ in range(max_steps):
            y, state = self.decoder(self.embed(token), state)  # T = 1, the state carried
            token = self.out(y).argmax(-1)  # [1, B]
            outputs.append(token[0])
        return torch.stack(outputs)


def exact_accuracy(model, batch: int, max_len: int, generator) -> float:
    """Fraction of strings whose greedy decoding is exactly the reversed digits, then END."""
    model.eval()
    source, lengths, _, target = make_batch(batch, max_len, generator)
    predicted = model.greedy(source, lengths, max_len + 1)
    valid = target != -100
    correct = ((predicted == target) | ~valid).all(0)
    model.train()
    return correct.float().mean().item()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000, help="training steps (default: 3000)")
    parser.add_argument("--seed", type=int, default=0, help="(default: 0)")
    parser.add_argument("--batch", type=int, default=128, help="strings per step (default: 128)")
    parser.add_argument("--max-len", type=int, default=8, help="longest digit string (default: 8)")
    parser.add_argument("--hidden", type=int, default=128, help="(default: 128)")
    parser.add_argument("--lr", type=float, default=3e-3, help="initial Adam learning rate, cosine-decayed to 0 (default: 3e-3)")
    parser.add_argument("--eval-every", type=int, default=500, help="(default: 500)")
    parser.add_argument("--test-size", type=int, default=2000, help="strings in the final test (default: 2000)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads; small steps run best on one (default: 1)")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data = torch.Generator().manual_seed(args.seed)
    model = Seq2Seq(args.hidden)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.steps)  # settles the last steps
    started, losses = time.perf_counter(), []
    for step in range(1, args.steps + 1):
        source, lengths, decoder_input, target = make_batch(args.batch, args.max_len, data)
        logits = model(source, lengths, decoder_input)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step % args.eval_every == 0:
            accuracy = exact_accuracy(model, 500, args.max_len, data)
            print(f"step {step}: loss {sum(losses[-50:]) / len(losses[-50:]):.4f}, "
                  f"exact-sequence accuracy {accuracy:.1%}", flush=True)
    test = torch.Generator().manual_seed(10_000 + args.seed)  # strings the training never drew from this stream
    accuracy = exact_accuracy(model, args.test_size, args.max_len, test)
    seconds = time.perf_counter() - started
    print(f"test: exact-sequence accuracy {accuracy:.2%} on {args.test_size} strings of 1-{args.max_len} digits "
          f"after {args.steps} steps, {seconds:.0f} s")
    window = max(1, min(20, len(losses) // 4))
    return {"accuracy": accuracy, "first_loss": sum(losses[:window]) / window,
            "last_loss": sum(losses[-window:]) / window, "seconds": seconds}


if __name__ == "__main__":
    main()
