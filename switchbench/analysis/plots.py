"""Figures of the routing analysis (saved with bench.results.save_figure as PNG and SVG)."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

LAST = 128  # positions shown of long inputs


def _labelled(ax, labels_y, labels_x):
    if len(labels_x) <= 64:
        ax.set_xticks(range(len(labels_x)), labels_x, rotation=90, fontsize=6)
    if len(labels_y) <= 64:
        ax.set_yticks(range(len(labels_y)), labels_y, fontsize=6)


def attention_maxima(models: dict[str, list[np.ndarray]], dst_labels, src_labels, title: str):
    """One row per model, one map per layer: the element-wise max over heads of the post-softmax attention."""
    n_layers = max(len(maps) for maps in models.values())
    fig, axes = plt.subplots(len(models), n_layers, figsize=(3 * n_layers, 3.2 * len(models)), squeeze=False)
    for row, (name, maps) in enumerate(models.items()):
        for layer in range(n_layers):
            ax = axes[row][layer]
            if layer >= len(maps):
                ax.axis("off")
                continue
            image = maps[layer][-LAST:, -LAST:]
            ax.imshow(image, cmap="Blues", vmin=0, vmax=max(float(image.max()), 1e-9), aspect="auto")
            _labelled(ax, dst_labels[-LAST:], src_labels[-LAST:])
            ax.set_title(f"{name}: layer {layer}", fontsize=8)
            ax.set_xlabel("source", fontsize=7)
            ax.set_ylabel("destination", fontsize=7)
    fig.suptitle(title)
    return fig


def expert_selection(att: np.ndarray, dst_gates: np.ndarray, src_gates: np.ndarray, dst_labels, src_labels,
                     title: str):  # fmt: skip
    """A head's attention map, its destination gates as a strip on the left (T x E) and its source gates as a
    strip below (E x S), gates on a fixed [0, 1] scale."""
    att, dst_gates, src_gates = att[-LAST:, -LAST:], dst_gates[-LAST:], src_gates[-LAST:]
    dst_labels, src_labels = dst_labels[-LAST:], src_labels[-LAST:]
    n_e = dst_gates.shape[1] if dst_gates.size else src_gates.shape[1]
    fig = plt.figure(figsize=(7, 7))
    grid = fig.add_gridspec(
        2, 3, width_ratios=[n_e, 40, 1.5], height_ratios=[40, n_e], wspace=0.05, hspace=0.05
    )
    ax_att = fig.add_subplot(grid[0, 1])
    ax_att.imshow(att, cmap="Blues", vmin=0, vmax=max(float(att.max()), 1e-9), aspect="auto")
    ax_att.set_xticks([])
    ax_att.set_yticks([])
    ax_att.set_title(title, fontsize=9)
    ax_dst = fig.add_subplot(grid[0, 0], sharey=ax_att)
    gates = ax_dst.imshow(dst_gates, cmap="Reds", vmin=0, vmax=1, aspect="auto")
    ax_dst.set_xticks(range(n_e), [str(e) for e in range(n_e)], fontsize=6)
    ax_dst.set_xlabel("O expert", fontsize=7)
    if len(dst_labels) <= 64:
        ax_dst.set_yticks(range(len(dst_labels)), dst_labels, fontsize=6)
    ax_dst.set_ylabel("destination", fontsize=7)
    ax_src = fig.add_subplot(grid[1, 1], sharex=ax_att)
    ax_src.imshow(src_gates.T, cmap="Reds", vmin=0, vmax=1, aspect="auto")
    ax_src.set_yticks(range(n_e), [str(e) for e in range(n_e)], fontsize=6)
    ax_src.set_ylabel("V expert", fontsize=7)
    if len(src_labels) <= 64:
        ax_src.set_xticks(range(len(src_labels)), src_labels, rotation=90, fontsize=6)
    ax_src.set_xlabel("source", fontsize=7)
    fig.colorbar(gates, cax=fig.add_subplot(grid[0, 2]), label="gate")
    return fig


def usage_bars(panels: list[tuple[str, np.ndarray]], title: str):
    """Sorted per-expert selection counts, one panel per (layer, head, side)."""
    cols = min(4, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3 * cols, 2.4 * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax, (name, counts) in zip(axes.flat, panels, strict=False):
        order = np.argsort(counts)[::-1]
        ax.bar(range(len(counts)), counts[order], color="tab:blue")
        ax.set_xticks(range(len(counts)), [str(e) for e in order], fontsize=6)
        ax.set_title(name, fontsize=8)
        ax.set_xlabel("expert (sorted by use)", fontsize=7)
        ax.set_ylabel("selections", fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def cooccurrence_grid(maps: dict[tuple[int, int], np.ndarray], title: str):
    """V-expert x O-expert counts, one panel per (layer, head): rows are layers, columns heads."""
    layers, heads = sorted({layer for layer, _ in maps}), sorted({head for _, head in maps})
    size = (2.6 * len(heads) + 1, 2.3 * len(layers))
    fig, axes = plt.subplots(len(layers), len(heads), figsize=size, squeeze=False)
    for (layer, head), counts in maps.items():
        ax = axes[layers.index(layer)][heads.index(head)]
        image = ax.imshow(counts, cmap="Blues", aspect="auto")
        ax.set_xticks(range(counts.shape[1]))
        ax.set_yticks(range(counts.shape[0]))
        ax.set_title(f"layer {layer}, head {head}", fontsize=8)
        ax.set_xlabel("O expert", fontsize=7)
        ax.set_ylabel("V expert", fontsize=7)
        fig.colorbar(image, ax=ax, fraction=0.05)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def training_curves(logs: dict[str, list[dict]], metric: str, title: str):
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, rows in logs.items():
        points = [(int(r["step"]), float(r[metric])) for r in rows if r.get(metric) not in (None, "")]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", ms=3, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel(metric.replace("_", " "))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig
