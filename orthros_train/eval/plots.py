"""PNG figures of the eval commands (matplotlib, headless). Imported lazily by each command."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("plots need matplotlib: pip install matplotlib (or pass --no-plot)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def niah_heatmap(
    scores: Sequence[Sequence[float]],
    lengths: Sequence[int],
    depths: Sequence[float],
    path: str | Path,
    title: str = "Needle in a haystack",
) -> Path:
    """The usual NIAH picture: depth (rows, 0% at the top) x context length (columns), score 0..1."""
    plt = _pyplot()
    from matplotlib.colors import LinearSegmentedColormap

    cmap = LinearSegmentedColormap.from_list("niah", ["#F0496E", "#EBB839", "#0CD79F"])
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(lengths) + 3), max(4, 0.45 * len(depths) + 2)))
    im = ax.imshow(scores, cmap=cmap, vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(lengths)), [_k(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}%" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            ax.text(j, i, f"{scores[i][j]:.2f}", ha="center", va="center", fontsize=7, color="black")
    fig.colorbar(im, ax=ax, label="score")
    ax.set_title(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def recall_curve(buckets: Sequence[dict], path: str | Path, window: int | None, title: str = "Recall vs distance"):
    """Accuracy per distance bucket (x: bucket label), with the sliding window marked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [b["label"] for b in buckets]
    acc = [b["accuracy"] if b["accuracy"] is not None else float("nan") for b in buckets]
    ax.plot(range(len(labels)), acc, marker="o")
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("distance from the key-value pair to its query (tokens)")
    ax.set_ylabel("accuracy")
    if window:
        for i, b in enumerate(buckets):
            if b["low"] >= window:
                ax.axvline(i - 0.5, color="gray", linestyle="--", label=f"window W={window}")
                ax.legend()
                break
    ax.set_title(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def bench_plot(rows: Sequence[dict], path: str | Path, title: str) -> Path:
    """Time to first token of the three models (log-log) and the prefill ratio against its FLOP
    limit, with the decode ratios, vs prompt length.

    Process CPU time where the rows carry it (CPU runs), wall clock otherwise.
    """
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    lengths = [r["length"] for r in rows]
    cpu = any("orthros_ttft_cpu_s" in r for r in rows)
    c = "_cpu" if cpu else ""

    def series(key: str) -> list[tuple[int, float]]:
        return [(r["length"], r[key]) for r in rows if r.get(key) is not None]

    for model, color, label in (("orthros", "C0", "Orthros"), ("peer", "C1", "transformers SDPA peer"),
                                ("dense", "C4", "dense baseline (this repo)")):  # fmt: skip
        pts = series(f"{model}_ttft{c}_s")
        if pts:
            ax1.plot(*zip(*pts), "-", marker="o", color=color, label=label)
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xticks(lengths, [_k(n) for n in lengths])
    ax1.set_xlabel("prompt length (tokens)")
    ax1.set_ylabel(f"time to first token (s, {'CPU time' if cpu else 'wall'})")
    ax1.legend(fontsize=8)
    ax1.grid(True, which="both", alpha=0.3)
    for key, style, label, marker, color in (
        ("flop_limit", ":", "FLOP-ratio limit (dense / Orthros)", None, "gray"),
        (f"peer_speedup{c}", "-", "prefill: peer / Orthros time", "o", "C2"),
        (f"prefill_speedup{c}", "--", "prefill: dense baseline / Orthros time", "o", "C2"),
        (f"peer_decode_ratio{c}", "-", "decode: Orthros / peer tokens/s", "s", "C3"),
    ):
        pts = series(key)
        if pts:
            ax2.plot(*zip(*pts), style, marker=marker, color=color, label=label)
    ax2.axhline(1.0, color="gray", linewidth=0.8)
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(lengths, [_k(n) for n in lengths])
    ax2.set_xlabel("prompt length (tokens)")
    ax2.set_ylabel("ratio")
    ax2.legend(fontsize=8)
    ax2.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _k(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)
