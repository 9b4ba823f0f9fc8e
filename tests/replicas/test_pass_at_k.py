"""pass@k from n samples of which c pass (Chen et al. 2021), checked against hand-computed values."""

import pytest

from composer_serverless.objectives.pass_at_k import pass_at_k, prompt_pass_at_k


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 0, 1, 0.0),
        (4, 1, 1, 0.25),  # pass@1 is the share that passes
        (4, 1, 2, 0.5),  # 1 - C(3, 2) / C(4, 2) = 1 - 3/6
        (4, 2, 2, 5 / 6),  # 1 - C(2, 2) / C(4, 2) = 1 - 1/6
        (4, 1, 4, 1.0),  # every 4-subset holds the one that passes
        (5, 3, 3, 1.0),  # C(2, 3) = 0: fewer failures than k
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7, 5) / C(10, 5)
        (1, 1, 1, 1.0),
    ],
)
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_pass(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-15)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)])
def test_impossible_counts_are_refused(n, c, k):
    with pytest.raises(ValueError, match=f"got n = {n}, c = {c}"):
        pass_at_k(n, c, k)


def test_a_prompt_passes_at_the_threshold_and_unscored_completions_are_not_samples():
    assert prompt_pass_at_k([1.0, 0.5, 0.0, 1.0], 2, threshold=1.0) == pytest.approx(5 / 6)
    assert prompt_pass_at_k([1.0, 0.5, 0.0, 1.0], 1, threshold=0.5) == pytest.approx(0.75)
    assert prompt_pass_at_k([None, 1.0, None, 0.0], 2, threshold=1.0) == pytest.approx(1.0)  # n = 2, c = 1
    assert prompt_pass_at_k([None, 1.0, None, 0.0], 3, threshold=1.0) is None
