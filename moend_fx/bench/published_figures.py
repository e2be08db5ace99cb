"""The two figures of the README, drawn from the committed records of the published tables.

* ``accuracy_vs_bytes.png``: task-averaged accuracy against the measured KV-cache bytes at their peak, one panel
  per (setting, length) in a grid (rows: settings; columns: lengths), one line per method over its budgets, the
  full cache as a dashed line; from ``docs/data/accuracy-2k4k`` and ``docs/data/accuracy-8k``.
* ``decode_speed.png``: decode tokens/s against batch size at the batch context, and ms per step against context
  at batch 1, one line per method; from ``docs/data/decode-cpu``.

Both are sized to be read at page width (about 9 inches wide at 100 dpi).
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moend_fx.common.errors import MoendError
from moend_fx.common.io import atomic_save_figure, atomic_write_bytes
from moend_fx.eval.summary import AVG

# One colour and marker per method, the same in every panel (the full cache is its own dashed line).
_STYLE = {"2d_hetero": ("C3", "o", "MoE-nD (2d_hetero)"), "2d_uniform": ("C0", "s", "2d_uniform"),
          "2d_uniform_matched": ("C9", "D", "2d_uniform_matched"), "2d": ("C1", "^", "2d (keep only)"),
          "pyramid": ("C2", "v", "pyramid"), "1d": ("C4", "P", "1d"),
          "hf_quant4": ("C5", "X", "HF QuantizedCache 4-bit"),
          "hf_fp8": ("C6", "*", "fp8"), "full_eager": ("C7", "s", "full cache, eager"),
          "full_inductor": ("C0", "^", "full cache, inductor"), "moend_eager": ("C1", "v", "MoE-nD, eager"),
          "moend_compiled": ("C3", "o", "MoE-nD, compiled (moend)")}


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _summary(folder: Path) -> list[dict[str, Any]]:
    path = folder / "results.json"
    if not path.is_file():
        raise MoendError(f"published record {path} is missing: the accuracy figure is drawn from it")
    return [r for r in json.loads(path.read_text())["summary"] if r["task"] == AVG and r["mean"] is not None]


def plot_accuracy_grid(data_dir: Path, path: Path) -> Path:
    """Accuracy vs peak KV bytes, a 2 x 3 grid (settings x lengths) from accuracy-2k4k and accuracy-8k."""
    plt = _plt()
    rows = _summary(data_dir / "accuracy-2k4k") + _summary(data_dir / "accuracy-8k")
    settings = sorted({r["setting"] for r in rows})
    lengths = sorted({r["target_length"] for r in rows})
    fig, axes = plt.subplots(len(settings), len(lengths), figsize=(9, 5.6), squeeze=False, sharey=True)
    for i, setting in enumerate(settings):
        for j, length in enumerate(lengths):
            ax = axes[i][j]
            cell = [r for r in rows if (r["setting"], r["target_length"]) == (setting, length)]
            for method, (color, marker, label) in _STYLE.items():
                pts = sorted((r.get("peak_bytes") or r["measured_bytes"], 100 * r["mean"])
                             for r in cell if r["method"] == method)
                if pts:
                    ax.plot([p[0] / 1e6 for p in pts], [p[1] for p in pts], color=color, marker=marker,
                            markersize=5, linewidth=1.2, label=label)
            full = [r for r in cell if r["method"] == "full"]
            if full:
                ax.axhline(100 * full[0]["mean"], color="0.3", linestyle="--", linewidth=1, label="full cache")
            ax.set_ylim(40, 102)
            ax.grid(alpha=0.3)
            n = max((r["n"] for r in cell if r["method"] == "2d_hetero"), default=0)
            ax.set_title(f"{setting.replace('_', '-')}, {length} tok (n={n})", fontsize=9)
            ax.tick_params(labelsize=8)
            if i == len(settings) - 1:
                ax.set_xlabel("KV cache MB at its peak" if length < 7900 else "KV cache MB after the prompt",
                              fontsize=8)
            if j == 0:
                ax.set_ylabel("accuracy %", fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle("passkey + niah_single (8k: niah_single), SmolLM2-135M; each line: a method at 14x and 20x",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0.09, 1, 0.97))
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    """PNG, written atomically, keeping the layout set by the caller (atomic_save_figure would lay it out
    again and drop the margin reserved for the figure's legend)."""
    plt = _plt()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return atomic_write_bytes(path, buf.getvalue())


def plot_decode_speed(data_dir: Path, path: Path) -> Path:
    """Decode tokens/s vs batch (at the batch context) and ms/step vs context (batch 1), from decode-cpu."""
    plt = _plt()
    src = data_dir / "decode-cpu" / "decode.json"
    if not src.is_file():
        raise MoendError(f"published record {src} is missing: the decode figure is drawn from it")
    result = json.loads(src.read_text())
    ok = [r for r in result["rows"] if r["status"] == "ok"]
    (bctx,) = set(result["meta"]["settings"]["batch_lengths"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    for method, (color, marker, label) in _STYLE.items():
        b = sorted((r["batch"], r["tokens_per_s"]) for r in ok if r["method"] == method and r["tokens"] == bctx)
        c = sorted((r["tokens"], r["ms_median"]) for r in ok if r["method"] == method and r.get("batch", 1) == 1)
        if len(b) > 1:
            left.plot(*zip(*b), color=color, marker=marker, label=label)
        if c:
            right.plot(*zip(*c), color=color, marker=marker, label=label)
    m = result["meta"]
    left.set(xscale="log", xlabel="batch size", ylabel="tokens/s (all rows)", ylim=(0, None))
    left.set_xscale("log", base=2)
    left.set_title(f"throughput at {bctx} tokens", fontsize=9)
    right.set_xscale("log", base=2)
    right.set(xlabel="context tokens", ylabel="ms per decode step", ylim=(0, None))
    right.set_title("batch 1", fontsize=9)
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
    left.legend(fontsize=7)
    fig.suptitle(f"decode on CPU, {m['model_name']} {m['model']['dtype']}, {m['threads']} threads, "
                 f"{m['settings']['budget']} plan", fontsize=9)
    return atomic_save_figure(fig, path, dpi=100)


FIGURES: dict[str, tuple[Callable[[Path, Path], Path], tuple[str, ...]]] = {
    "accuracy_vs_bytes.png": (plot_accuracy_grid, ("accuracy-2k4k", "accuracy-8k")),
    "decode_speed.png": (plot_decode_speed, ("decode-cpu",)),
}
