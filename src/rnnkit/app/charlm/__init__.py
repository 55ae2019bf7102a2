"""A character language model on an rnnkit stack, the model ``rnnkit train`` and ``rnnkit sample`` run.

The model is ``embedding -> rnnkit LSTM/GRU/RNN stack -> linear`` over characters, trained
with truncated backpropagation through time. One module per concern:

    data.py         the corpus (Python's stdlib or a UTF-8 file), the vocabulary, parallel streams
    model.py        ModelConfig and the network
    checkpoint.py   the run directory's files: atomic writes, config, vocabulary, checkpoints
    history.py      per-step and per-evaluation records: log.jsonl and the learning curve
    train.py        TrainConfig, the learning-rate schedule, one step, evaluation, the loop
    sample.py       generation, one character per step with the carried state

Everything that decides the result of a run (weights, optimizer moments, the carried state,
the random generators, the read position, the schedule's step and the history) is in the
checkpoint, so a resumed run computes exactly what the uninterrupted run computes.
"""
