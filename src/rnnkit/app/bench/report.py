"""What is written: the environment, JSON records, a markdown table, and a PNG of the speedups;
and the warnings that say when the numbers are not to be trusted."""
from __future__ import annotations

import datetime
import io
import json
import math
import mmap
import os
import platform
from typing import Dict, List, Optional, Tuple

import torch

import rnnkit

from ..files import atomic_write
from ..machine import cpu_flags, cpu_model


def environment(device: str, dtype: torch.dtype, threads: int, repeats: int, warmup: int, sgemm: float, sgemm_n: int) -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "rnnkit": rnnkit.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags() or [],
        "cpu_count": os.cpu_count(),
        "threads": threads,
        # other processes' load makes thread timings noisy (BENCH.md: ratios, never absolute times)
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else cpu_model(),
        "dtype": str(dtype).replace("torch.", ""),
        "repeats": repeats,
        "warmup": warmup,
        "sgemm_gflops": sgemm,
        "sgemm_n": sgemm_n,
        "rnnkit_backends": rnnkit.backends(),
        "speedup": "torch.nn median time / runner median time (> 1: faster than torch.nn)",
        "peak_memory": "torch.cuda.max_memory_allocated above the start, per call (CUDA); not measured on CPU",
        "saved_activation_bytes": "bytes autograd saves in one training forward (saved_tensors_hooks), weights and input excluded",
        "malloc": "kept: the process's malloc keeps the memory it frees (glibc mallopt), so no runner pays page "
                  "faults again at every call; default: glibc's own (rnnkit bench --default-malloc, or no glibc)",
        "page_faults_per_call": "minor page faults inside a timed call (getrusage), median over the repeats; None where "
                                "the OS does not count them",
        "calls_per_repeat": "calls in one timed repeat, synchronized before and after: 1 on the CPU; on CUDA enough "
                            "back-to-back calls to last 20 ms (at most 200), the time per call reported",
        "max_rel_rms_error": "the worst relative RMS error of a runner's outputs and gradients against float64, "
                             "checked before it is timed",
        "error_bound": "the bound that worst result was held to: the tolerance, or 2-3x the rnnkit reference's own "
                       "error in the same dtype where that is larger (float32 layer norm over long sequences)",
    }


# ---- warnings: noisy repeats, a busy machine ---------------------------------------------

SPREAD_LIMIT = 0.10  # repeats of one runner may disagree by this fraction of their median
# Other processes may keep this much of a core busy beyond the free cores before the run is called
# loaded: a 1-minute load average is never exactly 0 on an idle machine (0.01-0.1 here), and a
# benchmark pinned to its cores (taskset) has none to spare.
LOAD_SLACK = 0.5


def load_average() -> Optional[float]:
    """The 1-minute load average (None where the OS has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def spread_warnings(records: List[dict], limit: float = SPREAD_LIMIT) -> List[str]:
    """One line per timed record whose repeats disagree by more than ``limit`` of their median."""
    return [
        f"{r['runner']} / {r['shape']} / {r['variant']} / {r['mode']}: repeats disagree by "
        f"{100 * r['repeat_spread']:.0f}% of their median (> {100 * limit:.0f}%); its ratio is uncertain"
        for r in records
        if r["status"] == "ok" and r.get("repeat_spread", 0.0) > limit
    ]


# page faults a call from which the markdown names a runner: ~0.4 MB of fresh memory at 4 KB pages,
# where the runners that keep their memory between calls take 0-2
FAULT_LIMIT = 100


def page_fault_notes(records: List[dict], limit: int = FAULT_LIMIT) -> List[str]:
    """One line per timed record whose calls took ``limit`` or more page faults (median a call):
    memory its allocator got fresh from the OS at every call, which its time includes."""
    return [
        f"{r['runner']} / {r['shape']} / {r['variant']} / {r['mode']}: {r['page_faults_per_call']:,.0f} page faults a "
        f"call ({r['page_faults_per_call'] * mmap.PAGESIZE / 1e6:.1f} MB of memory fresh from the OS at every call)"
        for r in records
        if r["status"] == "ok" and (r.get("page_faults_per_call") or 0) >= limit
    ]


def load_warning(samples: List[Tuple[float, int]], cores: int, threads: int) -> Optional[str]:
    """A warning when other processes kept busy cores the benchmark needed, else None.

    ``samples``: (1-minute load average, threads of ours that were running during that minute).
    The load of others is the load average less our own threads; it is too high when it leaves
    fewer than ``threads`` of the ``cores`` free, by more than :data:`LOAD_SLACK` of a core.
    """
    if not samples:
        return None
    load, own = max(samples, key=lambda sample: sample[0] - sample[1])
    others = load - own
    if others <= cores - threads + LOAD_SLACK:
        return None
    return (f"load average {load:.2f} on {cores} cores: other processes kept ~{max(others, 0):.1f} cores busy while "
            f"the benchmark needed {threads} of the {cores}; timings and ratios are unreliable (run on an idle machine)")


def add_plain_ratios(records: List[dict]) -> None:
    """Give every timed record of an LSTM variant ``time_vs_torch_nn_plain_lstm``: its time ÷
    torch.nn's plain LSTM on the same shape and mode in the same run (the issue's "≤ 1.25× the
    time of torch.nn's plain LSTM" target; a time ratio, < 1 is faster). torch.nn's own LSTMP and
    per-layer chain are the speedup baselines of those variants; this ratio is against the plain
    LSTM instead. Absent where that run timed no plain torch.nn LSTM for the shape and mode."""
    plain = {
        (r["shape"], r["mode"]): r["median_ms"]
        for r in records
        if r["runner"] == "torch.nn" and r["variant"] == "lstm" and r["status"] == "ok"
    }
    for r in records:
        base = plain.get((r["shape"], r["mode"]))
        if base and r["status"] == "ok" and r["variant"].startswith("lstm") and r["variant"] != "lstm":
            r["time_vs_torch_nn_plain_lstm"] = r["median_ms"] / base


def write_json(path: str, env: dict, records: List[dict]) -> None:
    atomic_write(path, (json.dumps({"environment": env, "records": records}, indent=1) + "\n").encode("utf-8"))


def _number(value: float) -> str:
    """3 significant digits, without exponents: 0.0123, 4.56, 789, 12,345."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _time(record: dict) -> str:
    if "per_step_us" in record:
        return f"{_number(record['per_step_us'])} µs/step"
    return f"{_number(record['median_ms'])} ms"


def _cell(record: Optional[dict]) -> str:
    if record is None:
        return ""
    status = record["status"]
    if status != "ok":
        return "FAILED" if status == "failed" else "n/a"
    speedup = record.get("speedup_vs_torch_nn")
    text = _time(record)
    return text if speedup is None else f"{speedup:.2f}x ({text})"


def markdown(env: dict, records: List[dict], runners: List[str]) -> str:
    """One row per shape x variant x mode, one column per runner: speedup vs torch.nn (median ms)."""
    rows = {}
    for r in records:
        rows.setdefault((r["shape"], r["variant"], r["mode"]), {})[r["runner"]] = r
    flags = f" ({' '.join(env['cpu_flags']) or 'no AVX2'})" if env.get("device") == "cpu" and "cpu_flags" in env else ""
    libraries = env.get("sgemm_by_library") or {}
    by_library = f" (best of {', '.join(f'{name} {rate:.0f}' for name, rate in libraries.items())})" if len(libraries) > 1 else ""
    partial = env.get("cases_done") is not None and env.get("cases_done") != env.get("cases_planned")
    lines = [
        *([f"**Partial results**: this run stopped after {env['cases_done']} of its {env['cases_planned']} cases "
           "(shape × variant × mode); the rows below are the ones it finished.", ""] if partial else []),
        f"rnnkit bench: {env['device_name']}{flags}, {env['threads']} threads, torch {env['torch']}, {env['dtype']}, "
        f"median of {env['repeats']}{' (each repeat: back-to-back calls for 20 ms)' if env.get('device') == 'cuda' else ''}; sgemm {env['sgemm_gflops']:.0f} GFLOP/s{by_library}"
        + (f"; fused float32 GEMM: {env['fp32_gemm']}" if env.get("fp32_gemm") else "")
        + (f"; malloc {env['malloc'].split(':')[0]}" if env.get("malloc") else "")
        + ("" if env["load_average_1min"] is None else f"; load average {env['load_average_1min']:.2f}"),
        "",
        *(["**Warnings** (the numbers below may not hold on a re-run):", ""] if env.get("warnings") else []),
        *[f"- {w}" for w in env.get("warnings", [])],
        *([""] if env.get("warnings") else []),
        "Cells: speedup vs torch.nn (x, > 1 is faster) and median time (step API rows: per step). "
        "* torch.nn lacks the variant: "
        "its plain cell of the same mode and shape is the baseline. FAILED: the correctness check failed or the runner crashed (reason below). "
        "n/a: unavailable or unsupported (reason in the JSON).",
        *_low_precision_note(records),
        "",
        "| shape | variant | mode | " + " | ".join(runners) + " | torch.nn % sgemm |",
        "|" + "---|" * (len(runners) + 4),
    ]
    for (shape, variant, mode), by_runner in rows.items():
        base = by_runner.get("torch.nn")
        mark = "*" if base is not None and base.get("stand_in") else ""
        cells = [_cell(by_runner.get(name)) for name in runners]
        if base is not None and base["status"] == "ok":
            cells[runners.index("torch.nn")] = f"{_time(base)}{mark}"
        fraction = f"{100 * base['fraction_of_sgemm']:.1f}%" if base and base["status"] == "ok" else ""
        lines.append(f"| {shape} | {variant} | {mode} | " + " | ".join(cells) + f" | {fraction} |")
    lines += _plain_table(records, runners)
    faulting = page_fault_notes(records)
    if faulting:
        lines += ["", "Page faults inside the timed calls (median a call; the time of each includes them, and "
                  "how many a runner takes depends on what the process allocated before, so a ratio to such a "
                  "runner may differ in another process):"]
        lines += [f"- {note}" for note in faulting]
    failed = [r for r in records if r["status"] == "failed"]
    if failed:
        lines += ["", "Failed runners (a failed check, not timed, or a crash):"]
        lines += [f"- {r['runner']} / {r['shape']} / {r['variant']} / {r['mode']}: {r['reason']}" for r in failed]
    return "\n".join(lines) + "\n"


def _low_precision_note(records: List[dict]) -> List[str]:
    """A line naming the low-precision runners and the tolerance each was checked with; [] when none ran."""
    checked = {r["runner"]: (r["precision"], r["tolerance"]) for r in records if r.get("precision") and "tolerance" in r}
    if not checked:
        return []
    kernels = {r["runner"]: r["int8_kernel"] for r in records if r.get("int8_kernel")}
    return ["", "Low precision (speedups against torch.nn in float32): "
            + ", ".join(f"{name} ({precision}" + (f", {kernels[name]} kernels" if name in kernels else "") + ")"
                        for name, (precision, _) in checked.items())
            + ", checked against the float64 reference within relative RMS "
            + ", ".join(sorted({f"{tolerance:g}" for _, tolerance in checked.values()})) + " instead of the dtype's."]


def _plain_table(records: List[dict], runners: List[str]) -> List[str]:
    """LSTM variants as time ÷ torch.nn's plain LSTM (see add_plain_ratios); [] when none."""
    rows = {}
    for r in records:
        if "time_vs_torch_nn_plain_lstm" in r:
            rows.setdefault((r["shape"], r["variant"], r["mode"]), {})[r["runner"]] = r["time_vs_torch_nn_plain_lstm"]
    if not rows:
        return []
    names = [n for n in runners if any(n in by for by in rows.values())]
    lines = [
        "",
        "LSTM variants: time ÷ torch.nn's plain LSTM on the same shape and mode (< 1 is faster; "
        "torch.nn's own column times its LSTMP / per-layer chain / plain stand-in).",
        "",
        "| shape | variant | mode | " + " | ".join(names) + " |",
        "|" + "---|" * (len(names) + 3),
    ]
    for (shape, variant, mode), by in rows.items():
        cells = [f"{by[n]:.2f}" if n in by else "" for n in names]
        lines.append(f"| {shape} | {variant} | {mode} | " + " | ".join(cells) + " |")
    return lines


NICE_RATIOS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100)
FINE_RATIOS = (0.25, 0.5, 0.6, 0.7, 0.8, 0.9, 1, 1.1, 1.25, 1.5, 2, 3, 4)  # when the range is narrow


def plotted_runners(records: List[dict], runners: List[str], mode: str) -> List[str]:
    """The runners with a bar in ``mode``'s panel: timed (status ok) with a speedup; torch.nn is the line at 1."""
    return [
        name for name in runners
        if name != "torch.nn" and any(
            r["runner"] == name and r["mode"] == mode and r["status"] == "ok" and r.get("speedup_vs_torch_nn")
            for r in records
        )
    ]


def ratio_ticks(values: List[float]) -> Tuple[List[float], Tuple[float, float]]:
    """Plain ratio ticks (0.5, 1, 2, ...) covering ``values`` on a log axis -> (ticks, y limits)."""
    finite = [v for v in values if v and math.isfinite(v) and v > 0] or [1.0]
    low, high = min(min(finite), 1.0) / 1.25, max(max(finite), 1.0) * 1.25
    ticks = [t for t in NICE_RATIOS if low <= t <= high]
    if len(ticks) < 3:
        ticks = [t for t in FINE_RATIOS if low <= t <= high]
    return ticks, (low, high)


def plot(path: str, records: List[dict], runners: List[str]) -> Tuple[Optional[Dict[str, dict]], Optional[str]]:
    """Bar chart of speedups vs torch.nn, one panel per mode -> (what was drawn, None) or (None, why not).

    Only runners that were timed appear (an unavailable, unsupported or failed runner has
    no bar and no legend entry). The log-scale y axis is labelled with plain ratios.
    What was drawn, per mode: ``{"runners": legend labels, "yticklabels": tick texts}``.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator
    except ImportError:
        return None, "matplotlib is not installed (pip install matplotlib); skipped the plot"
    modes = [m for m in ("inference", "training") if plotted_runners(records, runners, m)]
    if not modes:
        return None, "no speedup over torch.nn was measured (torch.nn or every other runner was not timed); nothing to plot"
    cases = len({(r["shape"], r["variant"]) for r in records})
    widest = max(len(plotted_runners(records, runners, m)) for m in modes)
    fig, axes = plt.subplots(len(modes), 1, figsize=(max(8, 0.3 * cases * widest), 4 * len(modes)), squeeze=False)
    drawn = {}
    for ax, mode in zip(axes[:, 0], modes):
        names = plotted_runners(records, runners, mode)
        keys = list(dict.fromkeys((r["shape"], r["variant"]) for r in records if r["mode"] == mode))
        width = 0.8 / len(names)
        shown = []
        for j, name in enumerate(names):
            values = []
            for key in keys:
                r = next((r for r in records if (r["shape"], r["variant"], r["mode"], r["runner"]) == (*key, mode, name)), None)
                values.append(r["speedup_vs_torch_nn"] if r and r["status"] == "ok" and r.get("speedup_vs_torch_nn") else float("nan"))
            ax.bar([k + j * width for k in range(len(keys))], values, width, label=name)
            shown += values
        ax.set_yscale("log")
        ticks, limits = ratio_ticks(shown)
        ax.set_ylim(*limits)
        ax.yaxis.set_major_locator(FixedLocator(ticks))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.yaxis.set_minor_locator(NullLocator())
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(keys))])
        ax.set_xticklabels([f"{s}\n{v}" for s, v in keys], rotation=90, fontsize=7)
        ax.set_ylabel("speedup vs torch.nn (x)")
        ax.set_title(mode)
        ax.legend(fontsize=8)
        drawn[mode] = {"runners": [t.get_text() for t in ax.get_legend().get_texts()], "axes": ax}
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=100)
    atomic_write(path, image.getvalue())
    for mode in drawn:  # tick texts exist once the figure is drawn
        ax = drawn[mode].pop("axes")
        drawn[mode]["yticklabels"] = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
        drawn[mode]["minor_yticklabels"] = [t.get_text() for t in ax.get_yticklabels(minor=True) if t.get_text()]
    plt.close(fig)
    return drawn, None
