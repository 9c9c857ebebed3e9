"""How alike two models' attention patterns are, as numbers: per layer, the maximum over heads of each model's
post-softmax attention, compared one destination row at a time (Pearson correlation, Jensen–Shannon distance) and
averaged over the rows of every sequence of a sample."""

from itertools import combinations

import numpy as np


def row_pearson(a: np.ndarray, b: np.ndarray, visible: np.ndarray | None = None) -> np.ndarray:
    """[N] Pearson correlation of each row of a [N, S] with the same row of b over the row's ``visible`` columns
    (all by default); NaN where a row is constant there, or sees fewer than 3 (two points always correlate by +-1)."""
    visible = np.ones(a.shape, dtype=bool) if visible is None else visible

    def centred(x: np.ndarray) -> np.ndarray:
        mean = np.where(visible, x, 0.0).sum(axis=1, keepdims=True) / visible.sum(axis=1, keepdims=True)
        return np.where(visible, x - mean, 0.0)

    a, b = centred(a), centred(b)
    scale = np.sqrt((a * a).sum(axis=1) * (b * b).sum(axis=1))
    enough = visible.sum(axis=1) >= 3
    return np.divide((a * b).sum(axis=1), scale, out=np.full(len(a), np.nan), where=(scale > 0) & enough)


def row_js_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[N] Jensen–Shannon distance (base 2: 0 identical, 1 disjoint) between the rows of a and b [N, S], each
    row scaled to sum to 1 (a maximum over heads is not a distribution)."""
    p = a / a.sum(axis=1, keepdims=True)
    q = b / b.sum(axis=1, keepdims=True)
    m = (p + q) / 2
    divergence = (_kl(p, m) + _kl(q, m)) / 2
    return np.sqrt(np.clip(divergence, 0.0, 1.0))  # rounding can leave it a hair outside [0, 1]


def _kl(p: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Row-wise KL(p || m) in bits; 0·log 0 = 0 (m > 0 wherever p > 0)."""
    ratio = np.divide(p, m, out=np.ones_like(p), where=p > 0)
    return (p * np.log2(ratio)).sum(axis=1)


def compare(a: list[np.ndarray], b: list[np.ndarray], lengths: list[int], causal: bool = False) -> list[dict]:
    """Per layer, the mean over destination rows of both measures. a, b: per layer the maxima over heads
    [B, T, T] of one sample; only the first lengths[i] rows and columns of sequence i are real tokens. In a
    ``causal`` model row i is correlated over the keys it sees, 0..i: the zeros past them, in both models by
    construction, would count as agreement (they do not change the JS distance)."""
    rows = []
    for layer, (maps_a, maps_b) in enumerate(zip(a, b, strict=False)):
        pairs = [(x[:n, :n], y[:n, :n]) for x, y, n in zip(maps_a, maps_b, lengths, strict=True)]
        r = np.concatenate(
            [row_pearson(x, y, np.tri(len(x), dtype=bool) if causal else None) for x, y in pairs]
        )
        js = np.concatenate([row_js_distance(x, y) for x, y in pairs])
        rows.append(
            {
                "layer": layer,
                "pearson": float(np.nanmean(r)),
                "js_distance": float(js.mean()),
                "rows": int(np.isfinite(r).sum()),
            }
        )
    return rows


def similarity_table(
    maxima: dict[str, list[np.ndarray]], presets: dict[str, str], lengths: list[int], causal: bool = False
) -> list:
    """Every pair of models, layer by layer; a pair of the same preset (another seed) is the baseline: how alike
    two trainings of one architecture are."""
    return [
        {"model_a": x, "model_b": y, "baseline": presets[x] == presets[y]} | row
        for x, y in combinations(maxima, 2)
        for row in compare(maxima[x], maxima[y], lengths, causal)
    ]
