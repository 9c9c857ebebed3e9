"""Attention similarity: each measure against a hand computation and a naive float64 loop."""

import math
import statistics

import numpy as np
import pytest

from switchbench.analysis import similarity


def test_two_points_give_no_correlation():
    assert math.isnan(similarity.row_pearson(np.array([[1.0, 2]]), np.array([[5.0, 3]]))[0])  # would be -1


def test_pearson_by_hand():
    # deviations (-1, 0, 1) and (-4/3, -1/3, 5/3): products sum to 3, squares to 2 and 42/9
    r = similarity.row_pearson(np.array([[1.0, 2, 3], [5, 5, 5]]), np.array([[1.0, 2, 4], [1, 2, 3]]))
    assert r[0] == pytest.approx(3 / math.sqrt(2 * 42 / 9))
    assert math.isnan(r[1])  # a constant row has no correlation


def test_js_distance_by_hand():
    a = np.array([[1.0, 0], [2, 2], [0.3, 0.7]])
    b = np.array([[0.0, 1], [1, 0], [0.6, 1.4]])
    # row 1: p = (1/2, 1/2), q = (1, 0), m = (3/4, 1/4)
    kl_p = 0.5 * math.log2(0.5 / 0.75) + 0.5 * math.log2(0.5 / 0.25)
    kl_q = math.log2(1 / 0.75)
    d = similarity.row_js_distance(a, b)
    assert d == pytest.approx([1.0, math.sqrt((kl_p + kl_q) / 2), 0.0], abs=1e-7)


def _naive(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Pearson r with the standard library, JS distance with a loop, for one pair of rows."""
    p, q = [v / sum(x) for v in x], [v / sum(y) for v in y]
    m = [(a + b) / 2 for a, b in zip(p, q, strict=True)]
    kl = lambda u: sum(a * math.log2(a / c) for a, c in zip(u, m, strict=True) if a > 0)  # noqa: E731
    return statistics.correlation(list(x), list(y)), math.sqrt((kl(p) + kl(q)) / 2)


def test_compare_averages_rows_of_real_tokens_only():
    rng = np.random.default_rng(0)
    a, b = rng.random((2, 3, 3)), rng.random((2, 3, 3))  # 2 sequences of up to 3 tokens, one layer
    a[1, 2, :], a[1, :, 2] = 100.0, 100.0  # padding of the second sequence (length 2): must not count
    (row,) = similarity.compare([a], [b], lengths=[3, 2])
    pairs = [_naive(a[0, i], b[0, i]) for i in range(3)] + [
        _naive(a[1, i, :2], b[1, i, :2]) for i in range(2)
    ]
    # the second sequence's rows see two keys each: too few for a correlation, not for a distance
    assert row["pearson"] == pytest.approx(statistics.fmean(r for r, _ in pairs[:3]))
    assert row["js_distance"] == pytest.approx(statistics.fmean(d for _, d in pairs))
    assert row["rows"] == 3


def test_a_causal_row_is_compared_over_the_keys_it_sees():
    """Row i of a causal map attends to keys 0..i; the zeros past them, shared by construction, are no agreement."""
    rng = np.random.default_rng(2)
    a, b = np.tril(rng.random((1, 5, 5))), np.tril(rng.random((1, 5, 5)))
    (row,) = similarity.compare([a], [b], lengths=[5], causal=True)
    pairs = [_naive(a[0, i, : i + 1], b[0, i, : i + 1]) for i in range(2, 5)]  # rows 0, 1 see 1, 2 keys: no r
    assert row["pearson"] == pytest.approx(statistics.fmean(r for r, _ in pairs))
    assert row["rows"] == 3
    (whole,) = similarity.compare([a], [b], lengths=[5])
    assert whole["pearson"] > row["pearson"]  # the shared zeros inflate it


def test_identical_maps_and_the_baseline_flag():
    maps = [np.random.default_rng(1).random((4, 5, 5)) for _ in range(2)]
    table = similarity.similarity_table(
        {"d": maps, "s": maps, "d2": maps}, {"d": "x", "s": "y", "d2": "x"}, [5] * 4
    )
    assert [(r["model_a"], r["model_b"], r["baseline"]) for r in table[::2]] == [
        ("d", "s", False),
        ("d", "d2", True),
        ("s", "d2", False),
    ]
    assert all(
        r["pearson"] == pytest.approx(1) and r["js_distance"] == pytest.approx(0, abs=1e-6) for r in table
    )
