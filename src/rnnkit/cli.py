"""The ``rnnkit`` command: train, sample, bench, doctor.

    rnnkit train --out runs/stdlib              # a character model of Python's stdlib, a few minutes on CPU
    rnnkit sample runs/stdlib --prime "def " --length 300 --seed 1
    rnnkit doctor                               # versions, backends and why not, threads, extras
    rnnkit bench ...                            # see rnnkit bench --help

Every failure the user can cause (a bad flag value, a missing or empty corpus, a damaged
checkpoint, resuming with another configuration) ends with one line on stderr and a
non-zero exit status, and leaves the files already saved untouched. The model, data and
training logic live in :mod:`rnnkit.charlm`; this file only parses and reports.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import math
import os
import platform
import sys
from pathlib import Path
from typing import List, Optional

import torch

from . import charlm
from .charlm import UserError

EXIT_USAGE, EXIT_FAILURE, EXIT_INTERRUPTED = 2, 1, 130
EXTRAS = ("tqdm", "matplotlib", "safetensors", "ninja", "onnx", "onnxruntime")

# defaults of `rnnkit train` that are not part of a run's identity
DEFAULT_STEPS, DEFAULT_OUT = 2000, "rnnkit-run"
# One thread by default: a recurrent step is a small matrix product that gains little from
# more threads and loses much when the cores are shared (2-core machine, other jobs running:
# 0.08 s per default training step with 1 thread, 0.24 s with 2).
DEFAULT_THREADS = 1
DEFAULT_SETTINGS = {"eval_every": 100, "eval_chars": 50_000}  # saved in config.json; a resumed run reuses them


class Parser(argparse.ArgumentParser):
    """argparse, with errors on one line (the usage is one --help away)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# ---- argument types --------------------------------------------------------------------

def _number(kind, test, expected):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not test(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    parse.__name__ = expected  # argparse names the type in its messages
    return parse


positive_int = _number(int, lambda v: v > 0, "a positive integer")
non_negative_int = _number(int, lambda v: v >= 0, "a non-negative integer")
probability = _number(float, lambda v: 0.0 <= v < 1.0, "a probability in [0, 1)")
positive_float = _number(float, lambda v: math.isfinite(v) and v > 0, "a positive number")
non_negative_float = _number(float, lambda v: math.isfinite(v) and v >= 0, "a non-negative number")


# ---- the parser ------------------------------------------------------------------------

def build_parser(with_bench: bool = False) -> Parser:
    """The command's parser; ``with_bench`` imports rnnkit.bench to describe its flags."""
    from . import __version__, backend as backends_

    parser = Parser(prog="rnnkit", description="Recurrent layers for PyTorch: train, sample, benchmark, diagnose.")
    parser.add_argument("--version", action="version", version=f"rnnkit {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    model, training = charlm.MODEL_DEFAULTS, charlm.TRAIN_DEFAULTS
    train = commands.add_parser(
        "train", help="train a character language model",
        description="Train a character language model (embedding -> rnnkit stack -> linear) with truncated "
                    "BPTT. With no --text it reads Python's own standard library, so it needs no download. "
                    "Model and training flags left out take the defaults, or the saved values with --resume.",
    )
    data = train.add_argument_group("data and output")
    data.add_argument("--text", metavar="FILE", help="a UTF-8 text file (default: ~1 MB of the stdlib's *.py files)")
    data.add_argument("--out", metavar="DIR", default=DEFAULT_OUT,
                      help=f"checkpoint, config, vocabulary, log and plot go here (default: {DEFAULT_OUT})")
    data.add_argument("--resume", action="store_true", help="continue the run saved in --out from its last step")
    net = train.add_argument_group("model")
    net.add_argument("--cell", choices=charlm.CELLS, help=f"(default: {model['cell']})")
    net.add_argument("--hidden", type=positive_int, metavar="N", help=f"hidden size (default: {model['hidden']})")
    net.add_argument("--layers", type=positive_int, metavar="N", help=f"stacked layers (default: {model['layers']})")
    net.add_argument("--embedding", type=positive_int, metavar="N",
                     help=f"character embedding size (default: {model['embedding']})")
    net.add_argument("--peephole", action="store_true", default=None, help="LSTM peephole connections")
    net.add_argument("--layer-norm", action="store_true", default=None, help="layer-normalized cells")
    net.add_argument("--zoneout", type=probability, metavar="P", help=f"zoneout on h (default: {model['zoneout']})")
    net.add_argument("--dropout", type=probability, metavar="P",
                     help=f"dropout on the embedding, between layers and before the output (default: {model['dropout']})")
    net.add_argument("--proj", type=non_negative_int, metavar="P",
                     help=f"LSTM projection size, 0 for none (default: {model['proj']})")
    opt = train.add_argument_group("training")
    opt.add_argument("--steps", type=positive_int, metavar="N", default=DEFAULT_STEPS,
                     help=f"train until this step; with --resume, the new total (default: {DEFAULT_STEPS})")
    opt.add_argument("--seed", type=non_negative_int, metavar="S", help=f"(default: {training['seed']})")
    opt.add_argument("--bptt", type=positive_int, metavar="N",
                     help=f"characters per truncated-BPTT chunk (default: {training['bptt']})")
    opt.add_argument("--batch", type=positive_int, metavar="N", help=f"parallel streams (default: {training['batch']})")
    opt.add_argument("--lr", type=positive_float, metavar="LR", help=f"Adam learning rate (default: {training['lr']})")
    opt.add_argument("--clip", type=non_negative_float, metavar="NORM",
                     help=f"gradient-norm clipping, 0 for none (default: {training['clip']})")
    opt.add_argument("--eval-every", type=positive_int, metavar="N",
                     help=f"validate and checkpoint every N steps (default: {DEFAULT_SETTINGS['eval_every']})")
    opt.add_argument("--eval-chars", type=positive_int, metavar="N",
                     help=f"validation characters scored at each evaluation (default: {DEFAULT_SETTINGS['eval_chars']})")
    opt.add_argument("--threads", type=positive_int, metavar="N", default=DEFAULT_THREADS,
                     help=f"torch intra-op threads (default: {DEFAULT_THREADS}; more help large models on idle cores)")
    opt.add_argument("--backend", choices=backends_.names(), default="auto",
                     help="rnnkit backend (default: auto, the fastest available)")
    train.set_defaults(handler=_train)

    sample = commands.add_parser("sample", help="generate text from a trained model",
                                 description="Generate text from a checkpoint written by rnnkit train.")
    sample.add_argument("directory", metavar="DIR", help="the --out directory of rnnkit train")
    sample.add_argument("--prime", default="\n", help="text to start from (default: a newline)")
    sample.add_argument("--length", type=non_negative_int, default=500, metavar="N",
                        help="characters to generate (default: 500)")
    sample.add_argument("--temperature", type=non_negative_float, default=0.8, metavar="T",
                        help="softmax temperature; 0 is greedy (default: 0.8)")
    sample.add_argument("--seed", type=non_negative_int, default=0, metavar="S", help="(default: 0)")
    sample.add_argument("--backend", choices=backends_.names(), default="auto", help="(default: auto)")
    sample.add_argument("--threads", type=positive_int, metavar="N", default=DEFAULT_THREADS,
                        help=f"torch intra-op threads (default: {DEFAULT_THREADS})")
    sample.set_defaults(handler=_sample)

    doctor = commands.add_parser("doctor", help="versions, backends and why not, threads, extras",
                                 description="Report what rnnkit can use on this machine.")
    doctor.set_defaults(handler=_doctor)

    bench = commands.add_parser("bench", help="benchmark the backends",
                                description="Benchmark rnnkit's backends.")
    if with_bench:
        module = _bench_module()
        module.add_arguments(bench)
        bench.set_defaults(handler=module.run)
    return parser


def _bench_module():
    try:
        return importlib.import_module("rnnkit.bench")
    except ModuleNotFoundError as error:
        if error.name != "rnnkit.bench":
            raise
        raise UserError("rnnkit bench is not available in this installation (no rnnkit.bench module)") from None


# ---- train -------------------------------------------------------------------------------

def _tqdm():
    try:
        from tqdm import tqdm
    except ImportError:
        raise UserError("rnnkit train shows its progress with tqdm, which is not installed: pip install 'rnnkit[cli]'") from None
    return tqdm


def _resolve(args):
    """-> (model config, train config, vocabulary, train text, valid text, corpus record, settings)."""
    out = Path(args.out)
    given_model = {k: getattr(args, k) for k in charlm.MODEL_DEFAULTS if getattr(args, k) is not None}
    given_train = {k: getattr(args, k) for k in charlm.TRAIN_DEFAULTS if getattr(args, k) is not None}
    checkpoint = out / charlm.CHECKPOINT_FILE
    if args.resume:
        if not checkpoint.exists():
            raise UserError(f"--resume: no checkpoint in {out} ({charlm.CHECKPOINT_FILE} is missing)")
        model_config, saved, vocabulary = charlm.model_config_from(out)
        for section, given in (("model", given_model), ("training", given_train)):
            for key, value in given.items():
                if saved.get(section, {}).get(key) != value:
                    flag = "--" + key.replace("_", "-")
                    raise UserError(
                        f"--resume: {flag} {value} differs from the checkpoint's {saved[section].get(key)} in "
                        f"{out / charlm.CONFIG_FILE}; leave the flag out to continue that run, or choose another --out"
                    )
        corpus = saved.get("corpus", {})
        source = args.text or corpus.get("source", "stdlib")
        text = _corpus_text(source)
        if charlm.fingerprint(text) != corpus.get("sha256"):
            raise UserError(f"--resume: the corpus ({source}) is not the one the checkpoint in {out} was trained on")
        train_config = charlm.TrainConfig(**saved["training"])
        settings = {**DEFAULT_SETTINGS, **saved.get("settings", {})}
    else:
        if checkpoint.exists():
            raise UserError(f"{out} already holds a checkpoint; pass --resume to continue it, or choose another --out")
        source = str(Path(args.text).resolve()) if args.text else "stdlib"
        text = _corpus_text(args.text or "stdlib")
        vocabulary = charlm.Vocabulary.of(text)
        model_config = charlm.ModelConfig(vocab_size=len(vocabulary), **{**charlm.MODEL_DEFAULTS, **given_model})
        train_config = charlm.TrainConfig(**{**charlm.TRAIN_DEFAULTS, **given_train})
        corpus = {"source": source, "sha256": charlm.fingerprint(text), "chars": len(text)}
        settings = dict(DEFAULT_SETTINGS)
    settings.update({k: getattr(args, k) for k in DEFAULT_SETTINGS if getattr(args, k) is not None})
    train_text, valid_text = charlm.split(text)
    corpus.update(train_chars=len(train_text), valid_chars=len(valid_text))
    return model_config, train_config, vocabulary, train_text, valid_text, corpus, settings


def _corpus_text(source: str) -> str:
    if source == "stdlib":
        return charlm.stdlib_corpus()
    return charlm.read_corpus(source)


def _train(args) -> int:
    tqdm = _tqdm()
    charlm.require_safetensors()  # fail before training, not at the first checkpoint
    torch.set_num_threads(args.threads)
    model_config, train_config, vocabulary, train_text, valid_text, corpus, settings = _resolve(args)
    run = charlm.prepare(Path(args.out), model_config, train_config, vocabulary, train_text, valid_text, corpus,
                         backend=args.backend, resume=args.resume, settings=settings)
    start = run.progress.step
    if start >= args.steps:
        print(f"rnnkit: {args.out} is already at step {start} (--steps {args.steps}); nothing to do", file=sys.stderr)
        return 0
    parameters = sum(p.numel() for p in run.model.parameters())
    what = "the standard library" if corpus["source"] == "stdlib" else corpus["source"]
    print(
        f"rnnkit: {'resuming at step ' + str(start) if args.resume else 'training'}: {model_config.cell} "
        f"{model_config.layers}x{model_config.hidden}, {parameters:,} parameters, on {what} "
        f"({len(train_text):,} training / {len(valid_text):,} validation characters, "
        f"{len(vocabulary)} symbols) -> {args.out}",
        file=sys.stderr,
    )
    bar = tqdm(total=args.steps, initial=start, unit="step", file=sys.stderr, dynamic_ncols=True, mininterval=0.5)
    smooth = {"loss": None, "speed": None}

    def on_step(step, loss, chars_per_sec):
        for key, value in (("loss", loss), ("speed", chars_per_sec)):
            smooth[key] = value if smooth[key] is None else 0.9 * smooth[key] + 0.1 * value
        bar.set_postfix_str(
            f"loss {smooth['loss']:.3f}, {smooth['loss'] / math.log(2):.3f} bits/char, "
            f"{smooth['speed']:,.0f} char/s", refresh=False,
        )
        bar.update(1)

    notes = set()

    def on_eval(record):
        bar.write(f"step {record['step']}: validation {record['val_bpc']:.3f} bits/char "
                  f"(training {record['train_bpc']:.3f}), {record['chars_per_sec']:,.0f} char/s", file=sys.stderr)
        note = charlm.plot_curve(run.directory)
        if note and note not in notes:
            notes.add(note)
            bar.write(f"rnnkit: {note}", file=sys.stderr)

    try:
        charlm.train(run, args.steps, settings["eval_every"], settings["eval_chars"], on_step, on_eval)
    finally:
        bar.close()
    final = charlm.read_log(run.directory)[-1]
    print(
        f"rnnkit: step {final['step']}: validation {final['val_bpc']:.3f} bits/char, "
        f"{final['elapsed_s']:.0f} s of training; try: rnnkit sample {args.out}",
        file=sys.stderr,
    )
    return 0


# ---- sample ------------------------------------------------------------------------------

def _sample(args) -> int:
    torch.set_num_threads(args.threads)

    directory = Path(args.directory)
    if not directory.is_dir():
        raise UserError(f"{directory}: no such directory (the --out of rnnkit train)")
    model_config, _, vocabulary = charlm.model_config_from(directory)
    model = charlm.build_model(model_config, args.backend)
    charlm.load_checkpoint(directory, model)
    text = charlm.sample(model, vocabulary, args.prime, args.length, args.temperature, args.seed)
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return 0


# ---- doctor ------------------------------------------------------------------------------

def _doctor(args) -> int:
    import numpy

    import rnnkit

    print(f"rnnkit   {rnnkit.__version__}")
    print(f"torch    {torch.__version__}")
    print(f"numpy    {numpy.__version__}")
    print(f"python   {platform.python_version()} ({sys.executable})")
    print(f"platform {platform.platform()}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"threads  torch {torch.get_num_threads()} intra-op, {torch.get_num_interop_threads()} inter-op; "
          f"{cores} usable CPU cores")
    print(f"cuda     {torch.cuda.is_available()}" + (f" ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else ""))
    print("backends (auto takes, in this order, the first that can run the configuration):")
    for name, report in rnnkit.backends().items():
        status = "available" if report["available"] else f"unavailable: {report['reason']}"
        print(f"  {name:<10} {status}")
    print("extras:")
    for extra in EXTRAS:
        try:
            version = importlib.metadata.version(extra)
        except importlib.metadata.PackageNotFoundError:
            version = "not installed"
        print(f"  {extra:<12} {version}")
    return 0


# ---- entry point -------------------------------------------------------------------------

def main(argv: Optional[List[str]] = None) -> int:
    """Run the command; returns the exit status (the console script exits with it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser(with_bench=bool(argv) and argv[0] == "bench").parse_args(argv)
        return int(args.handler(args) or 0)
    except UserError as error:
        message = str(error)
    except OSError as error:  # e.g. an --out that cannot be written
        message = f"{error.filename}: {error.strerror}" if error.filename and error.strerror else str(error)
    except KeyboardInterrupt:
        print("rnnkit: interrupted; files already saved are kept", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"rnnkit: error: {message}", file=sys.stderr)
    return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
