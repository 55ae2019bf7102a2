"""Truncated backpropagation through time: carry the state across chunks, cut the graph between them.

A long sequence is trained in chunks of ``chunk`` steps. The final state of one chunk is
the initial state of the next, so the model sees the whole history, but it is detached:
gradients stop at the chunk boundary and memory stays bounded by the chunk length.

    python examples/truncated_bptt.py
"""
import math

import torch

import rnnkit

torch.manual_seed(0)
T, B, chunk = 2000, 8, 50
time = torch.arange(T + 1, dtype=torch.float32).unsqueeze(1)  # [T+1, 1]
periods = torch.linspace(20, 80, B)  # one sine wave per sequence
wave = torch.sin(2 * math.pi * time / periods).unsqueeze(2)  # [T+1, B, 1]
inputs, targets = wave[:-1], wave[1:]  # predict the next value

lstm = rnnkit.LSTM(1, 32)
head = torch.nn.Linear(32, 1)
optimizer = torch.optim.Adam([*lstm.parameters(), *head.parameters()], lr=1e-2)

for epoch in range(5):
    hx, total = None, 0.0  # a fresh state at the start of the sequence
    for start in range(0, T, chunk):
        y, hx = lstm(inputs[start : start + chunk], hx)  # the state carried in from the previous chunk
        loss = torch.nn.functional.mse_loss(head(y), targets[start : start + chunk])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        hx = rnnkit.detach_state(hx)  # keep the values, drop the graph (h_n, c_n)
        total += loss.item()
    print(f"epoch {epoch}: mean loss {total / (T // chunk):.5f}")
