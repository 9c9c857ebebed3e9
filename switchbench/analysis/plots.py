"""Figures of the routing analysis (saved with bench.results.save_figure as PNG and SVG).

Figures are made without pyplot, so no global figure state or backend choice leaks out of this module. Heat maps
of attention and gates are drawn with imshow, which an SVG embeds as one PNG per map: a vector square per cell
(seaborn's heatmap) made the attention maxima of three ListOps models a 6.3 MiB SVG.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from switchbench.core.results import new_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

LAST = 128  # positions shown of long inputs
TICK_LIMIT = 64  # more token labels than this are unreadable
# Inches per map of a grid: six layers and the row labels fit the report's width (about 12 inches).
PANEL = 2.0


def _seaborn():
    import seaborn  # here, not at the top: 0.7 s to import, which only the commands that draw should pay

    return seaborn


def attention_maxima(models: dict[str, list[np.ndarray]], title: str) -> Figure:
    """One row per model (named above it), one map per layer: the element-wise max over heads of the
    post-softmax attention. Axes count positions: at the size that fits the report, token labels would be
    unreadable; the tokens are in the analysis' metadata and in each head's selection figure."""
    n_layers = max(len(maps) for maps in models.values())
    fig = new_figure(
        figsize=(PANEL * n_layers + 0.6, (PANEL + 0.45) * len(models) + 0.4), layout="constrained"
    )
    rows = fig.subfigures(len(models), 1, squeeze=False)[:, 0]
    for row, (name, maps) in zip(rows, models.items(), strict=True):
        row.suptitle(name, fontsize=10, fontweight="bold")
        for layer, ax in enumerate(row.subplots(1, n_layers, squeeze=False)[0]):
            if layer >= len(maps):
                ax.axis("off")
                continue
            image = maps[layer][-LAST:, -LAST:]
            first = len(maps[layer]) - len(image)  # the position of the first row and column shown
            extent = (first - 0.5, first + len(image) - 0.5, first + len(image) - 0.5, first - 0.5)
            ax.imshow(
                image,
                cmap="Blues",
                vmin=0,
                vmax=max(float(image.max()), 1e-9),
                extent=extent,
                interpolation="nearest",
            )
            ax.locator_params(nbins=4)
            ax.tick_params(labelsize=8)
            ax.set_title(f"layer {layer}", fontsize=9)
            if layer == 0:
                ax.set_ylabel("destination", fontsize=8)
            if row is rows[-1]:
                ax.set_xlabel("source position", fontsize=8)
    fig.suptitle(title, fontsize=11)
    return fig


def expert_selection(
    att: np.ndarray, dst_gates: np.ndarray, src_gates: np.ndarray, dst_labels, src_labels, title: str
) -> Figure:
    """A head's attention map, its destination gates as a strip on the left (T x E) and its source gates as a
    strip below (E x S), gates on a fixed [0, 1] scale."""
    att, dst_gates, src_gates = att[-LAST:, -LAST:], dst_gates[-LAST:], src_gates[-LAST:]
    dst_labels, src_labels = dst_labels[-LAST:], src_labels[-LAST:]
    n_e = dst_gates.shape[1] if dst_gates.size else src_gates.shape[1]
    fig = new_figure(figsize=(7, 7))
    grid = fig.add_gridspec(
        2, 3, width_ratios=[n_e, 40, 1.5], height_ratios=[40, n_e], wspace=0.05, hspace=0.05
    )
    ax_att = fig.add_subplot(grid[0, 1])
    ax_att.imshow(att, cmap="Blues", vmin=0, vmax=max(float(att.max()), 1e-9), aspect="auto")
    ax_att.set_xticks([])
    ax_att.set_yticks([])
    ax_att.set_title(title, fontsize=9)
    # a side without experts (SwitchHead routing V alone) has an empty strip, left blank: drawn, it would reset the
    # limits its axis shares with the map, and turn the map upside down
    strip = dict(cmap="Reds", vmin=0, vmax=1, aspect="auto")
    ax_dst = fig.add_subplot(grid[0, 0], sharey=ax_att)
    drawn = [ax_dst.imshow(dst_gates, **strip)] if dst_gates.size else []
    ax_dst.xaxis.tick_top()  # above the strip: below it, its labels would meet the source strip's
    ax_dst.xaxis.set_label_position("top")
    ax_dst.set_xticks(range(n_e), [str(e) for e in range(n_e)], fontsize=6)
    ax_dst.set_xlabel("O expert", fontsize=7)
    if len(dst_labels) <= TICK_LIMIT:
        ax_dst.set_yticks(range(len(dst_labels)), dst_labels, fontsize=6)
    ax_dst.set_ylabel("destination", fontsize=7)
    ax_src = fig.add_subplot(grid[1, 1], sharex=ax_att)
    drawn += [ax_src.imshow(src_gates.T, **strip)] if src_gates.size else []
    ax_src.set_yticks(range(n_e), [str(e) for e in range(n_e)], fontsize=6)
    ax_src.set_ylabel("V expert", fontsize=7)
    if len(src_labels) <= TICK_LIMIT:
        ax_src.set_xticks(range(len(src_labels)), src_labels, rotation=90, fontsize=6)
    ax_src.set_xlabel("source", fontsize=7)
    fig.colorbar(drawn[0], cax=fig.add_subplot(grid[0, 2]), label="gate")
    # The strips' token ticks are shared with the map: on the map itself they would run into the source strip.
    ax_att.tick_params(bottom=False, left=False, labelbottom=False, labelleft=False)
    return fig


def usage_bars(panels: list[tuple[str, np.ndarray]], title: str) -> Figure:
    """Sorted per-expert selection counts, one panel per (layer, head, side)."""
    cols = min(4, len(panels))
    rows = -(-len(panels) // cols)
    fig = new_figure(figsize=(3 * cols, 2.4 * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax, (name, counts) in zip(axes.flat, panels, strict=False):
        order = [str(e) for e in np.argsort(counts, kind="stable")[::-1]]
        _seaborn().barplot(
            x=[str(e) for e in range(len(counts))], y=counts, order=order, color="tab:blue", ax=ax
        )
        ax.tick_params(labelsize=6)
        ax.set(title=name, xlabel="expert (sorted by use)", ylabel="selections")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def cooccurrence_grid(maps: dict[tuple[int, int], np.ndarray], title: str) -> Figure:
    """V-expert x O-expert counts, annotated, one panel per (layer, head): rows are layers, columns heads."""
    layers, heads = sorted({layer for layer, _ in maps}), sorted({head for _, head in maps})
    fig = new_figure(figsize=(3.2 * len(heads) + 1, 2.8 * len(layers)))
    axes = fig.subplots(len(layers), len(heads), squeeze=False)
    for (layer, head), counts in maps.items():
        ax = axes[layers.index(layer)][heads.index(head)]
        _seaborn().heatmap(
            counts,
            ax=ax,
            cmap="Blues",
            annot=True,
            fmt="d",
            annot_kws={"fontsize": 6},
            cbar_kws={"label": "tokens"},
        )
        ax.set(title=f"layer {layer}, head {head}", xlabel="O expert", ylabel="V expert")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def training_curves(logs: pd.DataFrame, metric: str, title: str) -> Figure:
    """``metric`` against step, one line per ``model`` of the concatenated training logs."""
    fig = new_figure(figsize=(8, 3.5), layout="constrained")
    ax = fig.subplots()
    _seaborn().lineplot(data=logs.dropna(subset=[metric]), x="step", y=metric, hue="model", marker="o", ax=ax)
    ax.set(xlabel="step", ylabel=metric.replace("_", " "), title=title)
    ax.grid(alpha=0.3)
    if ax.get_legend() is not None:  # none where matplotlib hides every label (a name starting with "_")
        _seaborn().move_legend(
            ax, "upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False
        )  # outside the data
    return fig


def similarity(rows: list[dict], title: str) -> Figure:
    """Pearson r and Jensen–Shannon distance against layer, one line per pair of models (baselines dashed)."""
    table = pd.DataFrame(rows)
    table["pair"] = table["model_a"] + " vs " + table["model_b"]
    table["compared"] = table["baseline"].map({True: "another seed", False: "another architecture"})
    fig = new_figure(figsize=(10, 3.6), layout="constrained")
    axes = fig.subplots(1, 2)
    for ax, (measure, label) in zip(
        axes, (("pearson", "Pearson r (1: alike)"), ("js_distance", "JS distance (0: alike)")), strict=True
    ):
        _seaborn().lineplot(
            data=table,
            x="layer",
            y=measure,
            hue="pair",
            style="compared",
            marker="o",
            ax=ax,
            legend=ax is axes[0],
        )
        ax.set(xlabel="layer", ylabel=label, ylim=(min(0.0, float(table[measure].min()) - 0.05), 1))
        ax.grid(alpha=0.3)
    # The legend below both panels, outside the data: inside, it covers lines wherever they run.
    handles, names = axes[0].get_legend_handles_labels()
    axes[0].get_legend().remove()
    fig.legend(handles, names, loc="outside lower center", ncol=2, fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    return fig


def quality(
    runs: pd.DataFrame, summary: pd.DataFrame, title: str, curves: pd.DataFrame | None = None
) -> Figure:
    """Held-out bits per byte against training MACs and against wall-clock: one point per run (its marker the
    seed), and each family's mean with its interval as an open diamond with error bars, drawn under the runs; with
    ``curves`` (each run's evaluations on the way), a first panel of each family's mean score against the passes
    over the training text, the seeds' range as a band."""
    palette = dict(zip(summary["family"], _seaborn().color_palette(n_colors=len(summary)), strict=True))
    runs = runs.assign(seed=runs["seed"].astype(str))
    panels = 2 if curves is None else 3
    fig = new_figure(figsize=(5.5 * panels, 4))
    axes = list(fig.subplots(1, panels))
    if curves is not None:  # first, on a scale of its own: the first evaluations score far above the last
        _held_out_curves(axes.pop(0), curves, palette)
    axes[1].sharey(axes[0])
    for ax, (x, label) in zip(
        axes,
        (
            ("train_macs", "training MACs (exact count)"),
            ("train_seconds", "wall-clock of the training steps (s)"),
        ),
        strict=True,
    ):
        for row in summary.itertuples():
            ax.errorbar(
                getattr(row, x),
                row.bpb_mean,
                yerr=[[row.bpb_mean - row.bpb_low], [row.bpb_high - row.bpb_mean]],
                fmt="D",
                color=palette[row.family],
                markerfacecolor="none",
                markersize=11,
                capsize=5,
                elinewidth=1,
                zorder=2,
            )
        _seaborn().scatterplot(
            data=runs,
            x=x,
            y="val_bits_per_byte",
            hue="family",
            style="seed",
            palette=palette,
            s=40,
            zorder=3,
            ax=ax,
            legend=ax is axes[-1],
        )
        ax.set(xlabel=label, ylabel="held-out bits per byte")
        ax.grid(alpha=0.3)
    axes[-1].legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def _held_out_curves(ax, curves: pd.DataFrame, palette: dict) -> None:
    _seaborn().lineplot(
        data=curves,
        x="passes_over_text",
        y="val_bits_per_byte",
        hue="family",
        palette=palette,
        errorbar=("pi", 100),  # the band spans the seeds
        legend=False,
        ax=ax,
    )
    ax.set(xlabel="passes over the training text", ylabel="held-out bits per byte")
    ax.grid(alpha=0.3)
