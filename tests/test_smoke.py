import torch

import rnnkit


def test_import_and_forward():
    lstm = rnnkit.LSTM(4, 6)
    y, (h, c) = lstm(torch.randn(3, 2, 4))
    assert y.shape == (3, 2, 6) and h.shape == (1, 2, 6) and c.shape == (1, 2, 6)
