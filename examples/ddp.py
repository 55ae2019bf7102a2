"""The character language model of ``rnnkit train``, trained with DistributedDataParallel.

    torchrun --nproc_per_node 2 examples/ddp.py --steps 200 --out runs/ddp   # 2 processes, gloo, CPU
    python examples/ddp.py --steps 200 --out runs/one                         # the same run in one process

The global batch is ``--batch`` parallel streams of the text (rnnkit.app.charlm.data.Streams); rank r
of W reads streams [r·B/W, (r+1)·B/W) and carries their state. Each rank's loss is the
mean over its own streams and DDP averages gradients over ranks, so every update equals
the one-process update on the whole global batch: both commands above end with the same
weights, up to float rounding in the all-reduce. Rank 0 writes ``weights.safetensors``
(torch.nn state_dict names) and prints the validation bits per character.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from rnnkit.app.charlm import checkpoint, data, model, train


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Train the character model with DDP (gloo, CPU).")
    parser.add_argument("--text", help="UTF-8 text file (default: ~1 MB of the standard library's *.py files)")
    parser.add_argument("--out", default="rnnkit-ddp", help="where rank 0 writes weights.safetensors")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cell", choices=model.CELLS, default="lstm")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--batch", type=int, default=32, help="global batch: streams over all ranks together")
    parser.add_argument("--bptt", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)

    distributed = "WORLD_SIZE" in os.environ  # set by torchrun
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be a multiple of the {world} processes")
    mine = slice(rank * args.batch // world, (rank + 1) * args.batch // world)

    text = data.read_corpus(args.text) if args.text else data.stdlib_corpus()
    train_text, valid_text = data.split(text)
    vocabulary = data.Vocabulary.of(text)
    streams = data.Streams(vocabulary.encode(train_text), args.batch, args.bptt)
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    network = model.build_model(model.ModelConfig(len(vocabulary), args.cell, args.hidden, args.layers))
    train_config = train.TrainConfig(seed=args.seed, bptt=args.bptt, batch=args.batch, lr=args.lr)
    ddp = DistributedDataParallel(network) if distributed else network
    optimizer = train.make_optimizer(ddp, train_config)

    state = None
    for step in range(args.steps):
        if step % streams.chunks == 0:
            state = None
        x, y = streams.chunk(step, mine)  # [bptt, B/W]: this rank's share of the global batch
        loss, state = train.train_step(ddp, optimizer, x, y, state, train_config.clip)
        if rank == 0 and (step + 1) % 50 == 0:
            print(f"step {step + 1}: training loss {loss:.3f} (rank 0's streams)", flush=True)

    if rank == 0:
        bpc = train.evaluate(network, vocabulary.encode(valid_text)[:20_001], args.batch, args.bptt)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        weights = {k: v.detach().clone().contiguous() for k, v in network.state_dict().items()}
        checkpoint.atomic_write(out / "weights.safetensors", checkpoint.require_safetensors().save(weights))
        print(f"{world} process(es), {args.steps} steps: validation {bpc:.3f} bits/char; weights in {out}")
    if distributed:
        dist.barrier()  # no rank leaves while another still talks to it (gloo aborts on a vanished peer)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
