"""pass@k: the chance that at least one of k samples drawn without replacement from a problem's n
samples is correct, given that c of the n are (Chen et al. 2021, "Evaluating Large Language Models
Trained on Code"). The unbiased estimator per problem is

    pass@k = 1 - C(n - c, k) / C(n, k)

averaged over problems. C(n, k) overflows floats for n in the hundreds, so it is computed as the
product  C(n-c, k) / C(n, k) = prod_{i = n-c+1}^{n} (1 - k / i),  one factor per correct sample
(empty, so pass@k = 0, when c = 0; pass@k = 1 when n - c < k, since then every k-subset holds a
correct sample).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from posttrain.errors import PosttrainError


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with n samples, c of them correct (needs 0 <= c <= n, 1 <= k <= n)."""
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise PosttrainError(f"pass@k: {name} must be an integer, got {value!r}")
    if not 0 <= c <= n:
        raise PosttrainError(f"pass@k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise PosttrainError(f"pass@k: k={k} must be in [1, n={n}] (k samples are drawn from the n)")
    if n - c < k:
        return 1.0
    all_wrong = 1.0  # C(n-c, k) / C(n, k)
    for i in range(n - c + 1, n + 1):
        all_wrong *= 1.0 - k / i
    return 1.0 - all_wrong


def mean_pass_at_k(counts: Sequence[tuple[int, int]], k: int) -> float:
    """pass@k averaged over problems; `counts` holds (n, c) per problem (n may differ between problems)."""
    if not counts:
        raise PosttrainError(f"pass@{k}: no problems to average over")
    return sum(pass_at_k(n, c, k) for n, c in counts) / len(counts)


def check_ks(ks: Iterable[int], n: int) -> list[int]:
    """The k values, sorted and deduplicated; each must be in [1, n] (the samples per problem)."""
    out = sorted(set(ks))
    if not out:
        raise PosttrainError("--k: give at least one k")
    for k in out:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise PosttrainError(f"--k: k={k!r} must be a positive integer")
        if k > n:
            raise PosttrainError(f"--k: k={k} is more than the n={n} samples per problem (raise --n or lower k)")
    return out
