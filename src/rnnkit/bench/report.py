"""What is written: the environment, JSON records, a markdown table, and a PNG of the speedups."""
from __future__ import annotations

import datetime
import json
import os
import platform
from typing import List, Optional

import torch

import rnnkit


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: str, dtype: torch.dtype, threads: int, repeats: int, warmup: int, sgemm: float, sgemm_n: int) -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "rnnkit": rnnkit.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
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
    }


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
    with open(path, "w") as f:
        json.dump({"environment": env, "records": records}, f, indent=1)
        f.write("\n")


def _cell(record: Optional[dict]) -> str:
    if record is None:
        return ""
    status = record["status"]
    if status != "ok":
        return "FAILED" if status == "failed" else "n/a"
    speedup = record.get("speedup_vs_torch_nn")
    text = f"{record['median_ms']:.3g} ms"
    return text if speedup is None else f"{speedup:.2f}x ({text})"


def markdown(env: dict, records: List[dict], runners: List[str]) -> str:
    """One row per shape x variant x mode, one column per runner: speedup vs torch.nn (median ms)."""
    rows = {}
    for r in records:
        rows.setdefault((r["shape"], r["variant"], r["mode"]), {})[r["runner"]] = r
    lines = [
        f"rnnkit bench: {env['device_name']}, {env['threads']} threads, torch {env['torch']}, {env['dtype']}, "
        f"median of {env['repeats']}; sgemm {env['sgemm_gflops']:.0f} GFLOP/s; load average {env['load_average_1min']}",
        "",
        "Cells: speedup vs torch.nn (x, > 1 is faster) and median time. * torch.nn lacks the variant: "
        "its plain cell of the same mode and shape is the baseline. FAILED: the correctness check failed, not timed. "
        "n/a: unavailable or unsupported (reason in the JSON).",
        "",
        "| shape | variant | mode | " + " | ".join(runners) + " | torch.nn % sgemm |",
        "|" + "---|" * (len(runners) + 4),
    ]
    for (shape, variant, mode), by_runner in rows.items():
        base = by_runner.get("torch.nn")
        mark = "*" if base is not None and base.get("stand_in") else ""
        cells = [_cell(by_runner.get(name)) for name in runners]
        if base is not None and base["status"] == "ok":
            cells[runners.index("torch.nn")] = f"{base['median_ms']:.3g} ms{mark}"
        fraction = f"{100 * base['fraction_of_sgemm']:.1f}%" if base and base["status"] == "ok" else ""
        lines.append(f"| {shape} | {variant} | {mode} | " + " | ".join(cells) + f" | {fraction} |")
    lines += _plain_table(records, runners)
    failed = [r for r in records if r["status"] == "failed"]
    if failed:
        lines += ["", "Failed checks (not timed):"]
        lines += [f"- {r['runner']} / {r['shape']} / {r['variant']} / {r['mode']}: {r['reason']}" for r in failed]
    return "\n".join(lines) + "\n"


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


def plot(path: str, records: List[dict], runners: List[str]) -> Optional[str]:
    """Bar chart of speedups vs torch.nn, one panel per mode; -> None, or why no plot was drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib); skipped the plot"
    modes = [m for m in ("inference", "training") if any(r["mode"] == m for r in records)]
    others = [n for n in runners if n != "torch.nn"]
    cases = len({(r["shape"], r["variant"]) for r in records})
    fig, axes = plt.subplots(len(modes), 1, figsize=(max(8, 0.3 * cases * max(1, len(others))), 4 * len(modes)), squeeze=False)
    for ax, mode in zip(axes[:, 0], modes):
        keys = list(dict.fromkeys((r["shape"], r["variant"]) for r in records if r["mode"] == mode))
        width = 0.8 / max(1, len(others))
        for j, name in enumerate(others):
            values = []
            for key in keys:
                r = next((r for r in records if (r["shape"], r["variant"], r["mode"], r["runner"]) == (*key, mode, name)), None)
                values.append(r["speedup_vs_torch_nn"] if r and r["status"] == "ok" and r.get("speedup_vs_torch_nn") else float("nan"))
            ax.bar([k + j * width for k in range(len(keys))], values, width, label=name)
        ax.set_yscale("log")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(keys))])
        ax.set_xticklabels([f"{s}\n{v}" for s, v in keys], rotation=90, fontsize=7)
        ax.set_ylabel("speedup vs torch.nn")
        ax.set_title(mode)
        if others:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None
