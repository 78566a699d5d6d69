"""The per-GPU token cap of an exchange (knapformer.planning.token_cap): both bags must
stay within the cap, a bag's tokens counted as the most one of its GPUs holds."""

from __future__ import annotations

import numpy as np

from knapformer.planning.token_cap import within_token_cap

TOKENS = np.array([9.0, 3.0, 8.0])
SIZE = np.array([2, 1, 4])


def test_a_move_is_allowed_only_while_the_receiving_bag_stays_under_the_cap():
    a, b = np.array([0, 0, 0]), np.array([1, 1, 1])
    got = within_token_cap(TOKENS, SIZE, a, b, np.array([1.0, 2.0, 3.0]), 5)
    assert got.tolist() == [True, True, False]  # 3 + 3 = 6 tokens on one GPU > 5


def test_the_giving_bag_counts_its_most_loaded_gpu():
    # 9 tokens on 2 GPUs: 5 on one (ceil 4.5), at the cap of 5; taking 2 back breaks it
    a, b = np.array([0, 0]), np.array([2, 2])
    got = within_token_cap(TOKENS, SIZE, a, b, np.array([0.0, -2.0]), 5)
    assert got.tolist() == [True, False]


def test_a_swap_checks_what_comes_back_and_broadcasts():
    # bag 1 (3 tokens, 1 GPU) swaps a 1-token sequence for a 4-token one (shift -3: it
    # ends at 6 > 5) or for a 3-token one (shift -2: it ends at 5), with bag 2 or bag 0
    a = np.array([[1]])
    b = np.array([[2, 0]])
    shift = np.array([[-3.0], [-2.0]])
    got = within_token_cap(TOKENS, SIZE, a, b, shift, 5)
    assert got.shape == (2, 2)
    assert got.tolist() == [[False, False], [True, True]]
