"""benchmarks/h100_validation.py's pure helpers: torchtitan's default pipeline split (the
one its code of the published 405B runs used, 9dec370) against hand-counted cases."""

import pytest

from tests.harness.benchmarks import benchmark_module


@pytest.fixture(scope="module")
def validation():
    with benchmark_module("h100_validation") as module:
        yield module


def test_torchtitan_split_by_hand(validation):
    split = validation.torchtitan_split
    # 126 layers on 8 stages: 15 first, the 6 left over one each to stages 1-6, 15 last
    assert split(126, 8) == (15, 16, 16, 16, 16, 16, 16, 15)
    # 2 stages per rank for Interleaved1F1B: 16 stages of 7, 14 x 8, 7
    assert split(126, 16) == (7,) + (8,) * 14 + (7,)
    # more left over than middle stages: the last stage takes the rest (11 = 2 + 3 + 3 + 3)
    assert split(11, 4) == (2, 3, 3, 3)
    assert split(10, 4) == (2, 3, 3, 2) and split(8, 4) == (2, 2, 2, 2)
    assert split(5, 1) == (5,) and split(5, 2) == (2, 3)
    for n, s in ((126, 8), (126, 16), (11, 4), (7, 3)):
        assert sum(split(n, s)) == n and len(split(n, s)) == s
    with pytest.raises(ValueError, match="more stages than layers"):
        split(3, 4)


def test_runs_names_repeated_counts(validation):
    assert validation.runs([15, 16, 16, 16, 15]) == "15/3x16/15"
    assert validation.runs([7]) == "7" and validation.runs([2, 2]) == "2x2"
