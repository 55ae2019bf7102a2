"""The applications built on rnnkit: the ``rnnkit`` command, the character language model, the benchmark.

They live apart from the library core (``rnnkit.spec``, ``params``, ``functional``, ``nn``,
the backends and ``interop``) and use it only through its public API, as any user would;
``import rnnkit`` does not import them.

    app/cli.py        the ``rnnkit`` command: train, sample, bench, doctor
    app/errors.py     UserError, the command's one-line error
    app/charlm/       the character language model: data, model, checkpoint, history, train, sample
    app/bench/        the benchmark: registry, runners, measure, report
"""
