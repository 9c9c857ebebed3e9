"""The analysis figures as the report shows them: drawn, then every title, legend and label checked against each
other and against the data lines, and every text large enough to read at the report's width."""

import itertools

import numpy as np
import pandas as pd
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text

from switchbench.analysis import plots
from switchbench.bench.cost import scaling
from switchbench.core.results import save_figure

REPORT_WIDTH = 1160  # pixels of the report's content column (body 1200 px less its padding)
SAVED_DPI = 100  # bench.results.save_figure
SMALLEST = 7  # pixels: the smallest text that can be read at the report's width
NAMES = [
    "listops-transformer-h8",
    "listops-switchhead-h2",
    "listops-transformer-h8-seed1",
]  # the real run names


def draw(fig: Figure):
    """Lay the figure out and draw it, as saving does; the renderer that measures its texts."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


def titles_and_legends(fig: Figure) -> list:
    """The suptitles of the figure and its subfigures, every axes title and every legend."""
    found = [f._suptitle for f in (fig, *fig.subfigs) if f._suptitle is not None]
    found += [
        title for ax in fig.axes for title in (ax.title, ax._left_title, ax._right_title) if title.get_text()
    ]
    return [*found, *fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend() is not None)]


def labels(fig: Figure) -> list[Text]:
    """Axis labels and tick labels that are shown."""
    found = []
    for ax in fig.axes:
        found += [label for label in (ax.xaxis.label, ax.yaxis.label) if label.get_text()]
        for axis, limits, which in ((ax.xaxis, ax.get_xlim(), 0), (ax.yaxis, ax.get_ylim(), 1)):
            low, high = sorted(limits)  # the locator also places ticks outside the view, which are not drawn
            found += [
                t
                for t in axis.get_ticklabels()
                if t.get_visible() and t.get_text() and low - 1e-9 <= t.get_position()[which] <= high + 1e-9
            ]
    return found


def texts(fig: Figure) -> list[Text]:
    legend_texts = [
        t for legend in fig.legends + [ax.get_legend() for ax in fig.axes] if legend for t in legend.texts
    ]
    return [t for t in titles_and_legends(fig) if isinstance(t, Text)] + labels(fig) + legend_texts


def overlapping(artists: list, renderer) -> list[tuple[str, str]]:
    boxes = [(artist, artist.get_window_extent(renderer)) for artist in artists]
    return [
        (_name(a), _name(b))
        for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2)
        if box_a.overlaps(box_b)
    ]


def covered_data(artists: list, fig: Figure, renderer) -> list[str]:
    """Titles and legends lying over a data line: any point of the line (its vertices and 20 points between each
    pair) inside the artist's box."""
    covered = []
    for ax in fig.axes:
        for line in ax.get_lines():
            xy = line.get_transform().transform(line.get_xydata())
            if len(xy) == 0:
                continue
            steps = np.linspace(0, 1, 21)[:, None, None]
            points = (xy[:-1] + steps * (xy[1:] - xy[:-1])).reshape(-1, 2) if len(xy) > 1 else xy
            for artist in artists:
                if artist.get_window_extent(renderer).count_contains(points):
                    covered.append(f"{_name(artist)} covers {line.get_label()}")
    return covered


def too_small(fig: Figure) -> list[str]:
    """Texts smaller than SMALLEST pixels once the saved figure is scaled to the report's width."""
    scale = min(1.0, REPORT_WIDTH / (fig.get_figwidth() * SAVED_DPI))
    return [
        f"{_name(t)} at {t.get_fontsize() * SAVED_DPI / 72 * scale:.1f} px"
        for t in texts(fig)
        if t.get_fontsize() * SAVED_DPI / 72 * scale < SMALLEST
    ]


def _name(artist) -> str:
    return repr(artist.get_text()) if isinstance(artist, Text) else type(artist).__name__


def similarity_rows() -> list[dict]:
    """The shape of the real similarity.csv: three pairs, six layers, the seed pair dashed."""
    rng = np.random.default_rng(0)
    pairs = [(NAMES[0], NAMES[1], False), (NAMES[0], NAMES[2], True), (NAMES[1], NAMES[2], False)]
    return [
        {
            "model_a": a,
            "model_b": b,
            "baseline": base,
            "layer": layer,
            "pearson": float(rng.uniform(0, 0.9)),
            "js_distance": float(rng.uniform(0.1, 0.8)),
            "rows": 100,
        }
        for a, b, base in pairs
        for layer in range(6)
    ]


def maxima(tokens: int = 41) -> dict[str, list[np.ndarray]]:
    rng = np.random.default_rng(0)
    return {name: [rng.dirichlet(np.full(tokens, 0.2), size=tokens) for _ in range(6)] for name in NAMES}


def curves() -> pd.DataFrame:
    rng = np.random.default_rng(0)
    return pd.DataFrame(
        [
            {"model": name, "step": step, "val_accuracy": rng.uniform()}
            for name in NAMES
            for step in range(50, 1001, 50)
        ]
    )


def selection(tokens: int = 41, experts: int = 4) -> tuple:
    """A head's map, its gates and ListOps-like token labels (an operator every fifth token)."""
    rng = np.random.default_rng(0)
    labels = ["[MAX" if i % 5 == 0 else str(i % 10) for i in range(tokens)]
    gates = rng.uniform(size=(tokens, experts)), rng.uniform(size=(tokens, experts))
    return rng.dirichlet(np.ones(tokens), size=tokens), *gates, labels, labels


FIGURES = {
    "similarity": lambda: plots.similarity(
        similarity_rows(), "Attention maxima compared row by row (256 sequences)"
    ),
    "attention maxima": lambda: plots.attention_maxima(maxima(), "Attention maxima over heads, per layer"),
    "training curves": lambda: plots.training_curves(curves(), "val_accuracy", "Validation accuracy"),
    "expert selection": lambda: plots.expert_selection(
        *selection(), title="listops-switchhead-h2, layer 0, head 0"
    ),
    "cost sweep": lambda: scaling.figure(scaling.sweep()),
}


@pytest.mark.parametrize(  # the seconds-long figures in the full suite only
    "figure",
    [
        pytest.param(f, marks=pytest.mark.slow) if f in ("attention maxima", "cost sweep") else f
        for f in FIGURES
    ],
)
def test_a_figure_is_readable_at_the_reports_width(figure):
    """Titles and legends cover no data line and no other text; labels collide with nothing; every text can
    be read once the figure is scaled to the report's width."""
    fig = FIGURES[figure]()
    renderer = draw(fig)
    boxes = titles_and_legends(fig)
    assert covered_data(boxes, fig, renderer) == []
    assert overlapping(boxes + labels(fig), renderer) == []
    assert too_small(fig) == []


def test_the_checks_find_what_they_look_for():
    """A legend over the data, two titles on one spot and tiny ticks are each caught."""
    fig = Figure(figsize=(6, 3))
    left, right = fig.subplots(1, 2)
    left.plot([0, 1], [0.5, 0.5], label="data")
    left.legend(loc="center")
    left.set_title("a long title " * 12)
    right.set_title("another")
    left.tick_params(labelsize=4)
    renderer = draw(fig)
    assert covered_data(titles_and_legends(fig), fig, renderer) == ["Legend covers data"]
    assert ("'" + "a long title " * 12 + "'", "'another'") in overlapping(titles_and_legends(fig), renderer)
    assert too_small(fig)


HEAT_MAPS = {  # the figure at the most positions it shows, its heat maps, the bound on its SVG
    "attention maxima": (lambda: plots.attention_maxima(maxima(plots.LAST), "maxima"), 3 * 6, 2**20),
    "expert selection": (lambda: plots.expert_selection(*selection(plots.LAST), title="head"), 3, 2**18),
}


@pytest.mark.parametrize(  # the attention maxima's 18 maps take seconds: in the full suite only
    "figure", [pytest.param(f, marks=pytest.mark.slow) if f == "attention maxima" else f for f in HEAT_MAPS]
)
def test_a_heat_map_is_one_image_in_its_svg(figure, tmp_path):
    """Committed SVGs stay small: each heat map is one embedded image, not a vector square per cell (seaborn's
    heatmap wrote 6.3 MiB for the ListOps attention maxima). Random maps compress worst, so they bound real ones."""
    draw_figure, maps, bound = HEAT_MAPS[figure]
    svg = save_figure(draw_figure(), tmp_path / "figure")[1]
    text = svg.read_text()
    assert "QuadMesh" not in text and text.count("<image") >= maps
    assert svg.stat().st_size <= bound


@pytest.mark.parametrize("side", ["destination", "source"])
def test_a_selection_map_keeps_its_first_token_on_top_when_a_side_has_no_experts(side):
    """SwitchHead with experts on V alone has no destination gates (and on O alone no source gates): the empty
    strip, which shares the map's axis, turned the map upside down (its first query drawn at the bottom)."""
    att, dst, src, dst_labels, src_labels = selection(tokens=12)
    empty = np.zeros((12, 0))
    gates = (empty, src) if side == "destination" else (dst, empty)
    fig = plots.expert_selection(att, *gates, dst_labels, src_labels, title="one side routed")
    ax_att = fig.axes[0]
    assert ax_att.get_ylim() == (11.5, -0.5) and ax_att.get_xlim() == (-0.5, 11.5)
