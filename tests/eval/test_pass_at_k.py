"""pass@k: the product form equals the closed form 1 - C(n-c, k) / C(n, k) everywhere, incl. the edges."""

from __future__ import annotations

from fractions import Fraction
from math import comb

import pytest

from posttrain.errors import PosttrainError
from posttrain.eval.pass_at_k import check_ks, mean_pass_at_k, pass_at_k


def closed_form(n: int, c: int, k: int) -> Fraction:
    return 1 - Fraction(comb(n - c, k), comb(n, k))  # comb(m, k) = 0 for m < k


def test_equals_the_closed_form_on_every_small_case():
    cases = 0
    for n in range(1, 16):
        for c in range(0, n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(closed_form(n, c, k)), abs=1e-12), (n, c, k)
                cases += 1
    assert cases == sum(n * (n + 1) for n in range(1, 16))


def test_edge_cases():
    assert pass_at_k(10, 0, 1) == 0.0 and pass_at_k(10, 0, 10) == 0.0  # c = 0: never
    assert pass_at_k(10, 8, 3) == 1.0  # n - c = 2 < k = 3: every 3-subset holds a correct sample
    assert pass_at_k(10, 1, 10) == 1.0  # k = n: one correct sample is enough
    assert pass_at_k(10, 0, 10) == 0.0
    assert pass_at_k(1, 1, 1) == 1.0 and pass_at_k(1, 0, 1) == 0.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is c / n
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6


def test_large_n_stays_finite_and_exact():
    # C(1000, 500) overflows a float; the product form does not
    for n, c, k in [(1000, 1, 500), (1000, 10, 100), (600, 300, 250), (1000, 999, 1)]:
        assert pass_at_k(n, c, k) == pytest.approx(float(closed_form(n, c, k)), rel=1e-9)


def test_mean_over_problems_with_different_n():
    counts = [(4, 0), (4, 2), (5, 5), (8, 1)]
    expected = sum(float(closed_form(n, c, 2)) for n, c in counts) / 4
    assert mean_pass_at_k(counts, 2) == pytest.approx(expected)


def test_bad_arguments_are_refused():
    with pytest.raises(PosttrainError, match=r"k=5 must be in \[1, n=4\]"):
        pass_at_k(4, 1, 5)
    with pytest.raises(PosttrainError, match=r"0 <= c <= n"):
        pass_at_k(4, 5, 1)
    with pytest.raises(PosttrainError, match="k must be an integer"):
        pass_at_k(4, 1, 1.0)
    with pytest.raises(PosttrainError, match="no problems"):
        mean_pass_at_k([], 1)
    with pytest.raises(PosttrainError, match=r"--k: k=8 is more than the n=4 samples"):
        check_ks([1, 8], 4)
    with pytest.raises(PosttrainError, match=r"k=0 must be a positive integer"):
        check_ks([0], 4)
    assert check_ks([4, 1, 4], 4) == [1, 4]
