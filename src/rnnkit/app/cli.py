"""The ``rnnkit`` command: train, sample, bench, doctor (also ``python -m rnnkit``).

    rnnkit train --out runs/stdlib              # a character model of Python's stdlib, a few minutes on CPU
    rnnkit train --out runs/stdlib --resume     # continue it (after Ctrl-C too) exactly where it stopped
    rnnkit sample runs/stdlib --prime "def " --length 300 --seed 1
    rnnkit eval runs/stdlib --best --precision int8   # validation bits/char in fp32, bf16 or int8
    rnnkit doctor                               # versions, backends and why not, threads, extras
    rnnkit bench ...                            # see rnnkit bench --help

Every failure the user can cause (a bad flag value, a missing or empty corpus, a damaged
checkpoint, resuming with another configuration) ends with one line on stderr and exit
status 1 (2 for flags argparse refuses), and leaves the files already saved untouched.
SIGINT (Ctrl-C) or SIGTERM during training checkpoints the step in progress and exits with
130 / 143; a second signal stops at once, keeping the previous checkpoint. The model, data
and training logic live in `rnnkit.app.charlm`; this file parses and reports.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import math
import os
import platform
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import List, Optional

import torch

import rnnkit

from . import errors, machine
from .charlm import checkpoint as files
from .charlm import data, history, model, sample, train
from .errors import UserError

EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130
EXTRAS = ("tqdm", "matplotlib", "safetensors", "ninja", "onnx", "onnxruntime")

# defaults of `rnnkit train` that are not part of a run's identity
DEFAULT_STEPS, DEFAULT_OUT = 2000, "rnnkit-run"
# One thread by default: a recurrent step is a small matrix product that gains little from
# more threads and loses much when the cores are shared (2-core machine, other jobs running:
# 0.08 s per default training step with 1 thread, 0.24 s with 2).
DEFAULT_THREADS = 1
DEFAULT_SETTINGS = train.DEFAULT_SETTINGS  # saved in config.json; a resumed run reuses them
DEVICES = ("auto", "cpu", "cuda")


class Parser(argparse.ArgumentParser):
    """argparse, with errors on one line (the usage is one --help away)."""

    commands = None  # the subcommands' parsers (build_parser sets it)

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        """argparse's, but a subcommand's unknown flag is reported by that subcommand's parser
        (``rnnkit train: error: ... (see rnnkit train --help)``), where argparse blamed ``rnnkit``."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = getattr(parsed, "command", None)
            owner = self.commands.choices.get(command, self) if self.commands is not None else self
            owner.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed


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


def path(text: str) -> str:
    """A file or directory argument: any non-empty text ('' would mean the current directory or no file)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a path, got ''")
    return text


path.__name__ = "a path"
positive_int = _number(int, lambda v: v > 0, "a positive integer")
non_negative_int = _number(int, lambda v: v >= 0, "a non-negative integer")
# torch.set_num_threads takes any int, and OpenMP crashes the process on what it cannot start
# (100,000 threads: a segmentation fault), so --threads stops at 1,024
MAX_THREADS = 1024
thread_count = _number(int, lambda v: 0 < v <= MAX_THREADS, f"an integer from 1 to {MAX_THREADS:,}")
# the model's sizes, as its configuration bounds them (model.MAX_WIDTH, MAX_LAYERS)
width = _number(int, lambda v: 0 < v <= model.MAX_WIDTH, f"an integer from 1 to {model.MAX_WIDTH:,}")
projection = _number(int, lambda v: 0 <= v <= model.MAX_WIDTH, f"an integer from 0 to {model.MAX_WIDTH:,}")
layer_count = _number(int, lambda v: 0 < v <= model.MAX_LAYERS, f"an integer from 1 to {model.MAX_LAYERS:,}")
probability = _number(float, lambda v: 0.0 <= v < 1.0, "a probability in [0, 1)")
fraction = _number(float, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]")
seed = _number(int, lambda v: 0 <= v < 2**63, "an integer in [0, 2^63)")  # what torch.manual_seed takes
positive_float = _number(float, lambda v: math.isfinite(v) and v > 0, "a positive number")
non_negative_float = _number(float, lambda v: math.isfinite(v) and v >= 0, "a non-negative number")


# ---- the parser ------------------------------------------------------------------------

def build_parser(with_bench: bool = False) -> Parser:
    """The command's parser; ``with_bench`` imports rnnkit.app.bench to describe its flags."""
    backends = ["auto", *rnnkit.backends()]
    parser = Parser(prog="rnnkit", description="Recurrent layers for PyTorch: train, sample, benchmark, diagnose.")
    parser.add_argument("--version", action="version", version=f"rnnkit {rnnkit.__version__}")
    commands = parser.commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    defaults, training = model.MODEL_DEFAULTS, train.TRAIN_DEFAULTS
    command = commands.add_parser(
        "train", help="train a character language model",
        description="Train a character language model (embedding -> rnnkit stack -> linear) with truncated "
                    "BPTT. With no --text it reads Python's own standard library, so it needs no download. "
                    "Model and training flags left out take the defaults, or the saved values with --resume. "
                    "Ctrl-C (SIGINT) or SIGTERM saves a checkpoint of the current step; --resume continues it exactly.",
    )
    group = command.add_argument_group("data and output")
    group.add_argument("--text", type=path, metavar="FILE", help="a UTF-8 text file (default: ~1 MB of the stdlib's *.py files)")
    group.add_argument("--out", type=path, metavar="DIR", default=DEFAULT_OUT,
                       help=f"checkpoints, config, vocabulary, log and plot go here (default: {DEFAULT_OUT})")
    group.add_argument("--resume", action="store_true", help="continue the run saved in --out from its last checkpoint")
    group = command.add_argument_group("model")
    group.add_argument("--cell", choices=model.CELLS, help=f"(default: {defaults['cell']})")
    group.add_argument("--hidden", type=width, metavar="N", help=f"hidden size (default: {defaults['hidden']})")
    group.add_argument("--layers", type=layer_count, metavar="N", help=f"stacked layers (default: {defaults['layers']})")
    group.add_argument("--embedding", type=width, metavar="N",
                       help=f"character embedding size (default: {defaults['embedding']})")
    group.add_argument("--peephole", action="store_true", default=None, help="LSTM peephole connections")
    group.add_argument("--layer-norm", action="store_true", default=None, help="layer-normalized cells")
    group.add_argument("--zoneout", type=probability, metavar="P", help=f"zoneout on h (default: {defaults['zoneout']})")
    group.add_argument("--dropout", type=probability, metavar="P",
                       help=f"dropout on the embedding, between layers and before the output (default: {defaults['dropout']})")
    group.add_argument("--proj", type=projection, metavar="P",
                       help=f"LSTM projection size, 0 for none (default: {defaults['proj']})")
    group = command.add_argument_group("training")
    group.add_argument("--steps", type=positive_int, metavar="N", default=DEFAULT_STEPS,
                       help=f"train until this step; with --resume, the new total (default: {DEFAULT_STEPS})")
    group.add_argument("--seed", type=seed, metavar="S", help=f"(default: {training['seed']})")
    group.add_argument("--bptt", type=positive_int, metavar="N",
                       help=f"characters per truncated-BPTT chunk (default: {training['bptt']})")
    group.add_argument("--batch", type=positive_int, metavar="N", help=f"parallel streams (default: {training['batch']})")
    group.add_argument("--lr", type=positive_float, metavar="LR", help=f"Adam's peak learning rate (default: {training['lr']})")
    group.add_argument("--schedule", choices=train.SCHEDULES,
                       help=f"learning-rate schedule after the warm-up (default: {training['schedule']})")
    group.add_argument("--warmup-steps", type=non_negative_int, metavar="N",
                       help=f"linear warm-up from 0 to --lr over the first N steps (default: {training['warmup_steps']})")
    group.add_argument("--final-lr-fraction", type=fraction, metavar="F",
                       help=f"cosine only: the learning rate ends at F x --lr (default: {train.DEFAULT_FINAL_LR_FRACTION})")
    group.add_argument("--decay-steps", type=positive_int, metavar="N",
                       help="cosine only: the step where the decay ends, then constant (default: --steps of the first run)")
    group.add_argument("--clip", type=non_negative_float, metavar="NORM",
                       help=f"gradient-norm clipping, 0 for none (default: {training['clip']})")
    group.add_argument("--precision", choices=train.PRECISIONS,
                       help=f"bf16: forward and loss under torch.autocast to bfloat16 (default: {training['precision']})")
    group.add_argument("--eval-every", type=positive_int, metavar="N",
                       help=f"validate and checkpoint every N steps (default: {DEFAULT_SETTINGS['eval_every']})")
    group.add_argument("--eval-chars", type=positive_int, metavar="N",
                       help=f"validation characters scored at each evaluation (default: {DEFAULT_SETTINGS['eval_chars']})")
    group = command.add_argument_group("where it runs (not part of the run: may change on --resume)")
    group.add_argument("--device", choices=DEVICES, default="auto", help="auto: cuda when available, else cpu (default: auto)")
    group.add_argument("--backend", choices=backends, default="auto",
                       help="rnnkit backend (default: auto, the fastest available)")
    group.add_argument("--threads", type=thread_count, metavar="N", default=DEFAULT_THREADS,
                       help=f"torch intra-op threads (default: {DEFAULT_THREADS}; more help large models on idle cores)")
    command.set_defaults(handler=_train)

    command = commands.add_parser("sample", help="generate text from a trained model",
                                  description="Generate text from a checkpoint written by rnnkit train.")
    command.add_argument("directory", type=path, metavar="DIR", help="the --out directory of rnnkit train")
    command.add_argument("--best", action="store_true",
                         help="use best.safetensors (lowest validation bits/char) instead of the latest checkpoint")
    command.add_argument("--prime", help="text to start from (default: a newline, or a space where the vocabulary "
                                           "has no newline)")
    command.add_argument("--length", type=non_negative_int, default=500, metavar="N",
                         help="characters to generate (default: 500)")
    command.add_argument("--temperature", type=non_negative_float, default=0.8, metavar="T",
                         help="softmax temperature; 0 is greedy (default: 0.8)")
    command.add_argument("--seed", type=seed, default=0, metavar="S", help="(default: 0)")
    command.add_argument("--device", choices=DEVICES, default="auto", help="(default: auto)")
    command.add_argument("--backend", choices=backends, default="auto", help="(default: auto)")
    command.add_argument("--threads", type=thread_count, metavar="N", default=DEFAULT_THREADS,
                         help=f"torch intra-op threads (default: {DEFAULT_THREADS})")
    command.set_defaults(handler=_sample)

    command.add_argument("--int8", action="store_true",
                         help="quantize the recurrent layers to int8 first (rnnkit.quantize; CPU)")

    command = commands.add_parser("eval", help="validation bits/char of a trained model, in fp32, bf16 or int8",
                                  description="Score a checkpoint written by rnnkit train on its validation text.")
    command.add_argument("directory", type=path, metavar="DIR", help="the --out directory of rnnkit train")
    command.add_argument("--best", action="store_true",
                         help="use best.safetensors (lowest validation bits/char) instead of the latest checkpoint")
    command.add_argument("--precision", choices=("fp32", "bf16", "int8"), default="fp32",
                         help="fp32; bf16 (under torch.autocast); int8 (the recurrent layers through rnnkit.quantize, "
                              "CPU) (default: fp32)")
    command.add_argument("--chars", type=positive_int, metavar="N",
                         help="validation characters to score (default: all of them)")
    command.add_argument("--text", type=path, metavar="FILE", help="the corpus the run was trained on, if not the default")
    command.add_argument("--device", choices=DEVICES, default="auto", help="(default: auto)")
    command.add_argument("--backend", choices=backends, default="auto", help="(default: auto)")
    command.add_argument("--threads", type=thread_count, metavar="N", default=DEFAULT_THREADS,
                         help=f"torch intra-op threads (default: {DEFAULT_THREADS})")
    command.set_defaults(handler=_eval)

    command = commands.add_parser("doctor", help="versions, backends and why not, threads, extras",
                                  description="Report what rnnkit can use on this machine.")
    command.set_defaults(handler=_doctor)

    command = commands.add_parser("bench", help="benchmark the backends against torch.nn",
                                  description="Benchmark rnnkit's backends against torch.nn (benchmarks/README.md's protocol).")
    if with_bench:
        from . import bench

        bench.add_arguments(command)
        command.set_defaults(handler=bench.run)
    return parser


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise errors.no_cuda()
    return torch.device(name)


def _check_kernel_variables() -> None:
    """A UserError now, rather than a traceback at the first product, for a $RNNKIT_*_KERNEL /
    $RNNKIT_FP32_GEMM this build and CPU cannot run. Only variables that are set are checked
    (checking loads the fused kernels, which they choose among)."""
    from rnnkit import fused

    for variable, ask in (("RNNKIT_FP32_GEMM", fused.fp32_gemm), ("RNNKIT_BF16_KERNEL", fused.bf16_kernel),
                          ("RNNKIT_INT8_KERNEL", rnnkit.quantized.int8_kernel)):
        if os.environ.get(variable, "auto") in ("", "auto"):
            continue
        try:
            ask()
        except ValueError as error:
            raise UserError(f"${str(error).strip().splitlines()[0]}") from None
        except RuntimeError:  # the fused kernels cannot load here: the variable has nothing to choose among
            return


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
    given_model = {k: getattr(args, k) for k in model.MODEL_DEFAULTS if getattr(args, k) is not None}
    given_train = {k: getattr(args, k) for k in train.TRAIN_DEFAULTS if getattr(args, k) is not None}
    if args.resume:
        if not (out / files.CHECKPOINT_FILE).exists():
            raise UserError(f"--resume: no checkpoint in {out} ({files.CHECKPOINT_FILE} is missing)")
        saved = train.read_run(out)
        given_settings = {"eval_chars": args.eval_chars} if args.eval_chars is not None else {}
        for section, given in ((dataclasses.asdict(saved.model), given_model),
                               (dataclasses.asdict(saved.training), given_train), (saved.settings, given_settings)):
            for key, value in given.items():
                was = section[key]
                if was != value:
                    flag, config = model.flag(key), out / files.CONFIG_FILE
                    said = (f"{flag}: the run in {config} was trained {'with' if was else 'without'} it"
                            if isinstance(value, bool) else
                            f"{flag} {value} differs from the run's {'unset value' if was is None else was} in {config}")
                    why = " (its best checkpoint compares scores on that many characters)" if key == "eval_chars" else ""
                    raise UserError(f"--resume: {said}{why}; leave the flag out to continue that run, or choose "
                                    f"another --out")
        text = saved.corpus_text(args.text)
        model_config, train_config, vocabulary = saved.model, saved.training, saved.vocabulary
        corpus, settings = dict(saved.corpus), dict(saved.settings)
        if args.text is not None:  # the same corpus (its fingerprint matched), perhaps moved: remember where it is now
            corpus["source"] = str(Path(args.text).resolve())
    else:
        files.check_fresh_directory(out)
        values = {**train.TRAIN_DEFAULTS, **given_train}
        if values["schedule"] == "cosine":  # the cosine's defaults; with a constant schedule these flags are refused
            values["final_lr_fraction"] = given_train.get("final_lr_fraction", train.DEFAULT_FINAL_LR_FRACTION)
            values["decay_steps"] = given_train.get("decay_steps", args.steps)
        try:
            train_config = train.TrainConfig(**values)
        except ValueError as error:
            implied = " (--decay-steps defaults to --steps)" if str(error).startswith("--decay-steps") and \
                "decay_steps" not in given_train else ""
            raise UserError(f"{error}{implied}") from None
        source = str(Path(args.text).resolve()) if args.text is not None else "stdlib"
        text = data.read_corpus(args.text) if args.text is not None else data.stdlib_corpus()
        vocabulary = data.Vocabulary.of(text)
        try:
            model_config = model.ModelConfig(vocab_size=len(vocabulary), **{**model.MODEL_DEFAULTS, **given_model})
        except ValueError as error:
            raise UserError(str(error)) from None
        corpus = {"source": source, "sha256": data.fingerprint(text), "chars": len(text)}
        settings = dict(DEFAULT_SETTINGS)
    settings.update({k: getattr(args, k) for k in DEFAULT_SETTINGS if getattr(args, k) is not None})
    train_text, valid_text = data.split(text)
    corpus.update(train_chars=len(train_text), valid_chars=len(valid_text))
    return model_config, train_config, vocabulary, train_text, valid_text, corpus, settings


def _command(*words) -> str:
    """A command line to print for the user to copy: every word quoted for the shell where it needs it."""
    return shlex.join(str(word) for word in words)


def _path_word(path: str) -> str:
    """A path as a command-line word argparse reads as a value: ``-x`` would read as a flag, ``./-x`` does not."""
    return f"./{path}" if path.startswith("-") else path


def _where_it_runs(args) -> list:
    """The flags of --device / --backend / --threads that differ from their defaults, to repeat in a printed command."""
    words = []
    if args.device != "auto":
        words += ["--device", args.device]
    if args.backend != "auto":
        words += ["--backend", args.backend]
    if args.threads != DEFAULT_THREADS:
        words += ["--threads", args.threads]
    return words


class Interruption:
    """SIGINT and SIGTERM while training: the first asks the loop to checkpoint the step in
    progress and stop (calling the object says whether it did); a second stops at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.received: Optional[int] = None
        self._previous = {}

    def __enter__(self) -> "Interruption":
        if threading.current_thread() is threading.main_thread():  # Python delivers signals there only
            for number in self.SIGNALS:
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)

    def _handle(self, number, frame) -> None:
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = number

    def __call__(self) -> bool:
        return self.received is not None


def _train(args) -> int:
    opened: list = []
    try:
        return _train_run(args, opened)
    finally:
        for run in opened:  # the directory's lock: free for the next rnnkit train, in this process too
            run.close()


def _train_run(args, opened: list) -> int:
    tqdm = _tqdm()
    files.require_safetensors()  # fail before training, not at the first checkpoint
    _check_kernel_variables()
    torch.set_num_threads(args.threads)
    device = _device(args.device)
    with Interruption() as interruption:
        model_config, train_config, vocabulary, train_text, valid_text, corpus, settings = _resolve(args)
        run = train.prepare(Path(args.out), model_config, train_config, vocabulary, train_text, valid_text, corpus,
                            backend=args.backend, device=device, resume=args.resume, settings=settings,
                            steps=args.steps)
        opened.append(run)
        if run.removed_temporaries:
            print(f"rnnkit: removed {len(run.removed_temporaries)} temporary file(s) that killed writes left in "
                  f"{args.out}: {', '.join(run.removed_temporaries)}", file=sys.stderr)
        start = run.progress.step
        if start >= args.steps:
            print(f"rnnkit: {args.out} is already at step {start} (--steps {args.steps}); nothing to do", file=sys.stderr)
            return 0
        if train_config.precision == "bf16" and device.type == "cpu" and machine.has_bf16() is False:
            print("rnnkit: note: this CPU has no bfloat16 instructions (avx512_bf16 / amx_bf16); bf16 runs slower "
                  "than fp32 here", file=sys.stderr)
        parameters = sum(p.numel() for p in run.model.parameters())
        # a path's undecodable bytes (surrogate escapes) shown as U+FFFD: the plot's title cannot take them
        what = "the standard library" if corpus["source"] == "stdlib" else \
            corpus["source"].encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        print(
            f"rnnkit: {'resuming at step ' + str(start) if args.resume else 'training'}: {model_config.cell} "
            f"{model_config.layers}x{model_config.hidden}, {parameters:,} parameters, on {what} "
            f"({len(train_text):,} training / {len(valid_text):,} validation characters, "
            f"{len(vocabulary)} symbols), {device.type} {train_config.precision} -> {args.out}",
            file=sys.stderr,
        )
        title = f"{model_config.cell} {model_config.layers}x{model_config.hidden} on {what}"
        bar = tqdm(total=args.steps, initial=start, unit="step", file=sys.stderr, dynamic_ncols=True, mininterval=0.5)
        speed = [None]
        notes = set()

        def plot():
            note = history.plot_curve(run.directory, run.history, title)[1]
            if note and note not in notes:
                notes.add(note)
                bar.write(f"rnnkit: {note}", file=sys.stderr)

        def on_step(info):
            speed[0] = info["chars_per_sec"] if speed[0] is None else 0.9 * speed[0] + 0.1 * info["chars_per_sec"]
            bar.set_postfix_str(f"{_training_number(info['interval_bpc'], info['interval_steps'])}, "
                                f"lr {info['lr']:.2e}, {speed[0]:,.0f} char/s", refresh=False)
            bar.update(1)

        def on_eval(record):
            best = "" if record["best"] else f" (best {run.progress.best_val_bpc:.3f} at step {run.progress.best_step})"
            bar.write(f"step {record['step']}: validation {record['val_bpc']:.3f} bits/char{best}, "
                      f"{_training_number(record['train_bpc'], record['train_steps'])}, "
                      f"{record['chars_per_sec']:,.0f} char/s", file=sys.stderr)
            plot()

        try:
            finished = train.train(run, args.steps, settings["eval_every"], settings["eval_chars"], on_step, on_eval,
                                   stop=interruption)
        except KeyboardInterrupt:
            bar.close()
            kept = f"its checkpoint of step {run.saved_step}" if run.saved_step is not None else "no checkpoint"
            print(f"rnnkit: interrupted again: stopped at once without saving; {args.out} keeps {kept}", file=sys.stderr)
            return EXIT_INTERRUPTED
        finally:
            bar.close()
    if not finished:
        plot()
        name = signal.Signals(interruption.received).name
        again = ["rnnkit", "train", "--out", _path_word(args.out), "--resume"]  # config.json has the corpus's absolute path
        again += (["--steps", args.steps] if args.steps != DEFAULT_STEPS else []) + _where_it_runs(args)
        print(f"rnnkit: {name}: saved the checkpoint of step {run.progress.step} in {args.out}; continue with: "
              f"{_command(*again)}", file=sys.stderr)
        return 128 + interruption.received
    final = run.history.evaluations[-1]
    best = f"; best {run.progress.best_val_bpc:.3f} at step {run.progress.best_step}" if run.progress.best_step != final["step"] else ""
    print(
        f"rnnkit: step {final['step']}: validation {final['val_bpc']:.3f} bits/char{best}, "
        f"{final['elapsed_s']:.0f} s of training; try: {_command('rnnkit', 'sample', _path_word(args.out))}",
        file=sys.stderr,
    )
    return 0


def _training_number(bpc: float, steps: int) -> str:
    """The one training number the progress bar and the evaluation line show, labelled the same way."""
    return f"train {bpc:.3f} bits/char (mean of the last {steps} step{'s' if steps != 1 else ''})"


# ---- sample ------------------------------------------------------------------------------

def _trained(args):
    """-> (network on its device, the run's saved configuration `train.SavedRun`) from a run directory's checkpoint."""
    _check_kernel_variables()
    torch.set_num_threads(args.threads)
    flag = _int8_flag(args)
    device = torch.device("cpu") if flag and args.device == "auto" else _device(args.device)  # int8: the CPU's kernels
    directory = Path(args.directory)
    if not directory.is_dir():
        what = "not a directory" if directory.exists() else "no such directory"
        raise UserError(f"{directory}: {what} (expected the --out directory of rnnkit train)")
    saved = train.read_run(directory)
    if flag and args.backend != "auto":
        raise UserError(f"--backend {args.backend}: with {flag} the recurrent layers run on rnnkit's int8 kernels "
                        f"(rnnkit.quantize), not on a backend; leave --backend out")
    network = model.build_model(saved.model, args.backend)
    path = directory / (files.BEST_FILE if args.best else files.CHECKPOINT_FILE)
    checkpoint = files.Checkpoint.read(path)
    files.check_same_run(path, checkpoint, saved.identity)
    try:
        network.load_state_dict(checkpoint.model, strict=True)
    except RuntimeError as error:
        raise UserError(f"{path}: does not match {directory / files.CONFIG_FILE} ({files.error_reason(error)})") from None
    return network.to(device), saved


def _int8_flag(args) -> Optional[str]:
    """The flag that asked for int8 (sample's --int8, eval's --precision int8), or None."""
    if getattr(args, "int8", False):
        return "--int8"
    return "--precision int8" if getattr(args, "precision", None) == "int8" else None


def _int8(network, flag: str):
    if next(network.parameters()).device.type != "cpu":
        raise UserError(f"{flag}: int8 runs on the CPU; add --device cpu")
    return rnnkit.quantize(network.eval())


def _sample(args) -> int:
    network, saved = _trained(args)
    precision = saved.training.precision
    if args.int8:
        network, precision = _int8(network, _int8_flag(args)), "fp32"
    else:
        train.check_precision(network, precision, args.backend)
    prime = args.prime if args.prime is not None else sample.default_prime(saved.vocabulary)
    pieces = sample.generate(network, saved.vocabulary, prime, args.length, args.temperature, args.seed, precision)
    if hasattr(sys.stdout, "reconfigure"):  # a terminal that cannot show a character gets its escape, not a traceback
        sys.stdout.reconfigure(errors="backslashreplace")
    last = ""
    for piece in pieces:  # as it comes: the prime, then a line (or 256 characters) at a time
        sys.stdout.write(piece)
        sys.stdout.flush()
        last = piece or last
    if not last.endswith("\n"):
        sys.stdout.write("\n")
    return 0


def _eval(args) -> int:
    network, saved = _trained(args)
    _, valid_text = data.split(saved.corpus_text(args.text))
    ids = saved.vocabulary.encode(valid_text)
    if args.chars is not None:
        ids = ids[: args.chars + 1]
    precision = args.precision
    if precision == "int8":
        network, precision = _int8(network, _int8_flag(args)), "fp32"
    else:
        train.check_precision(network, precision, args.backend)
    bpc = train.evaluate(network, ids, saved.training.batch, saved.training.bptt, precision)
    print(f"validation bits/char {bpc:.4f} ({args.precision}, {len(ids) - 1} characters, "
          f"{files.BEST_FILE if args.best else files.CHECKPOINT_FILE})")
    return 0


# ---- doctor ------------------------------------------------------------------------------

def _kernel_line(ask, expected, variable: str, table: dict, what: str, instructions: str) -> str:
    """Which kernels of a family run: asked of the fused kernels (``ask()``) where they are built
    (loading them), else foretold from the CPU's features (``expected(flags, capability)``; the
    doctor builds nothing). ``variable`` overrides the choice; ``table`` describes each kernel;
    ``instructions`` says what the CPU has for them."""
    from rnnkit.fused import build

    state = build.status()
    if state == "loaded" or state.startswith("built"):
        try:
            name = ask()
        except (RuntimeError, ValueError) as error:  # a failed load, or a bad value of the variable
            return f"unavailable ({error})"
        how = "in use"
    elif not state.startswith("not built"):  # the fused kernels cannot build here: why
        return f"unavailable (the {what} kernels are the fused backend's: {state})"
    else:
        name = expected(machine.cpu_flags(), torch.backends.cpu.get_cpu_capability())
        how = "expected; the fused kernels are not built yet"
        if os.environ.get(variable):
            how += f"; ${variable}={os.environ[variable]} will override it"
    return f"{name} kernels ({how}): {table[name]}; {instructions}"


def _int8_kernel_line() -> str:
    flags = machine.cpu_flags() or []
    vnni = [f for f in ("avx512_vnni", "avx_vnni") if f in flags]
    return _kernel_line(rnnkit.quantized.int8_kernel, machine.expected_int8_kernel, "RNNKIT_INT8_KERNEL",
                        rnnkit.quantized.INT8_KERNELS, "int8",
                        f"this CPU has {', '.join(vnni)}" if vnni else "no VNNI on this CPU")


def _bf16_kernel_line() -> str:
    """The GEMM kernels of a bfloat16 module's batches and training."""
    from rnnkit import fused

    return _kernel_line(fused.bf16_kernel, machine.expected_bf16_kernel, "RNNKIT_BF16_KERNEL", fused.BF16_KERNELS,
                        "bfloat16", "this CPU has bf16 instructions" if machine.has_bf16() else
                        "no bf16 instructions on this CPU")


def _fp32_gemm_line() -> str:
    """The GEMM kernels of the fused passes in float32."""
    from rnnkit import fused

    flags = machine.cpu_flags() or []
    return _kernel_line(fused.fp32_gemm, machine.expected_fp32_gemm, "RNNKIT_FP32_GEMM", fused.FP32_GEMMS,
                        "float32", "this CPU has AVX-512" if "avx512f" in flags else "no AVX-512 on this CPU")


def _doctor(args) -> int:
    import numpy

    reports = rnnkit.backends()  # before the kernel lines below load the fused kernels to ask them
    print(f"rnnkit   {rnnkit.__version__}")
    print(f"torch    {torch.__version__}")
    print(f"numpy    {numpy.__version__}")
    print(f"python   {platform.python_version()} ({sys.executable})")
    print(f"platform {platform.platform()}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"threads  torch {torch.get_num_threads()} intra-op, {torch.get_num_interop_threads()} inter-op; "
          f"{cores} usable CPU cores")
    print(f"cuda     {torch.cuda.is_available()}" + (f" ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else ""))
    if torch.cuda.is_available():
        from rnnkit.native import cudnn_report

        print(f"cudnn    {cudnn_report()}")
    print(f"cpu      {machine.cpu_model()} ({', '.join(machine.cpu_flags() or []) or 'no AVX2'}); torch dispatches to {torch.backends.cpu.get_cpu_capability()}; "
          f"oneDNN bf16 {'yes' if torch.ops.mkldnn._is_mkldnn_bf16_supported() else 'no'}")
    print(f"int8     rnnkit.quantize: {_int8_kernel_line()}")
    print(f"fp32     fused CPU backend: {_fp32_gemm_line()}")
    print(f"bf16     fused CPU backend: {_bf16_kernel_line()}")
    print("backends (auto takes, in this order, the first that can run the configuration; on the CPU fused goes "
          f"first but for an LSTM's inference of a padded batch of {rnnkit.backend.NATIVE_MIN_BATCH} rows or more in "
          "float32 / bf16 / fp16, and its float32 training or lengths with such a batch on a CPU without AVX-512):")
    for name, report in reports.items():
        status = report["status"] if report["available"] else f"unavailable: {report['reason']}"
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
    """Run the command; returns the exit status (``python -m rnnkit`` and the console script exit with it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser(with_bench=bool(argv) and argv[0] == "bench").parse_args(argv)
        return int(args.handler(args) or 0)
    except UserError as error:
        message = str(error)
    except rnnkit.BackendUnavailableError as error:  # a named --backend that cannot run this model here
        message = f"--backend: {error}"
    except OSError as error:  # e.g. an --out that cannot be written
        message = f"{error.filename}: {error.strerror}" if error.filename and error.strerror else str(error)
    except KeyboardInterrupt:
        print("rnnkit: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"rnnkit: error: {message}", file=sys.stderr)
    return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
