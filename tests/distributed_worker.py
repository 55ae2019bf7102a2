"""The two-process side of test_core_parameters.py: DDP and FSDP2 over gloo on the CPU.

    torchrun --nproc_per_node 2 tests/distributed_worker.py OUT

Every case trains with DistributedDataParallel, then with FSDP2's ``fully_shard``; rank r of W
computes on its share [r·B/W, (r+1)·B/W) of the same global batch, with a loss averaged over its
own share, so every update equals the one-process update on the whole batch. Rank 0 writes
``OUT/<wrapper>-<case>.pt``: the full (unsharded) gradients of every step and the final weights.
The test runs :func:`train` in its own process with ``world=1`` and compares.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

import rnnkit

I, H, P, T, GLOBAL_BATCH, STEPS = 3, 4, 2, 4, 4, 3

CASES = {  # id -> (module factory, backend): the backend named as the user would
    "lstm-bi-auto": (lambda backend: rnnkit.LSTM(I, H, 2, bidirectional=True, backend=backend, dtype=torch.float64),
                     "auto"),
    "lstm-peephole-ln-fused": (lambda backend: rnnkit.LSTM(I, H, peephole=True, layer_norm=True, backend=backend,
                                                           dtype=torch.float64), "fused"),
    "lstm-proj-fused": (lambda backend: rnnkit.LSTM(I, H, 2, proj_size=P, backend=backend, dtype=torch.float64),
                        "fused"),
    "gru-reset-before-reference": (lambda backend: rnnkit.GRU(I, H, reset_after=False, backend=backend,
                                                              dtype=torch.float64), "reference"),
}
WRAPPERS = ("ddp", "fsdp2")


def build(case: str) -> torch.nn.Module:
    """The case's module with the same initial weights in every process."""
    factory, backend = CASES[case]
    torch.manual_seed(0)
    return factory(backend)


def _full(t):
    """A gradient or weight as one plain tensor (FSDP2 holds DTensor shards)."""
    if t is None:
        return None
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().clone()


def train(module: torch.nn.Module, case: str, rank: int = 0, world: int = 1, runner=None) -> dict:
    """STEPS AdamW steps on this rank's share of the global batch -> {"grads": [{name: grad} per
    step], "params": {name: weight}, "backend": what ran}. ``runner`` is the wrapped module (DDP)."""
    runner = runner or module
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1)
    generator = torch.Generator().manual_seed(7)
    mine = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    grads = []
    for _ in range(STEPS):
        x = torch.randn(T, GLOBAL_BATCH, I, generator=generator, dtype=torch.float64)
        y, _ = runner(x[:, mine])
        target = torch.randn(T, GLOBAL_BATCH, y.shape[-1], generator=generator, dtype=torch.float64)
        optimizer.zero_grad()
        ((y - target[:, mine]) ** 2).mean().backward()
        grads.append({n: _full(p.grad) for n, p in module.named_parameters()})
        optimizer.step()
    return {"grads": grads, "params": {n: _full(p) for n, p in module.named_parameters()},
            "backend": module.last_backend}


def main(out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    for wrapper in WRAPPERS:
        for case in CASES:
            module = build(case)
            if wrapper == "ddp":
                result = train(module, case, rank, world, runner=DistributedDataParallel(module))
            else:
                fully_shard(module, mesh=mesh)
                result = train(module, case, rank, world)
            if rank == 0:
                torch.save(result, out / f"{wrapper}-{case}.pt")
            print(f"rank {rank}: {wrapper} {case} done", flush=True)
    dist.barrier()  # no rank leaves while another still talks to it (gloo aborts on a vanished peer)
    dist.destroy_process_group()
    # Every result is written: leave without the interpreter's teardown, where torch's gloo threads
    # can still abort the process ("terminate called without an active exception", SIGABRT) after
    # destroy_process_group; seen once in CI (2026-11-28) after both ranks had finished every case.
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
