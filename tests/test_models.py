"""The reference packed-sequence DiT, single process (no balancer)."""

from __future__ import annotations

import pytest
import torch

from knapformer.local.models import ToyDiT, apply_rope, attention, positions_in_sequences


def _model(rope: bool = True) -> ToyDiT:
    torch.manual_seed(0)
    return ToyDiT(32, 4, 2, rope=rope).double()


def test_sequences_do_not_see_each_other():
    model = _model()
    lens = [5, 0, 9, 5, 1]
    x = torch.randn(sum(lens), 32, dtype=torch.float64)
    out = model(x, lens)
    assert out.shape == x.shape
    # each sequence alone gives the same rows as inside the pack
    start = 0
    for n in lens:
        if n:
            alone = model(x[start : start + n], [n])
            torch.testing.assert_close(out[start : start + n], alone)
        start += n
    # changing one sequence leaves the others' outputs unchanged
    x2 = x.clone()
    x2[5:14] += torch.randn(9, 32, dtype=torch.float64)
    out2 = model(x2, lens)
    torch.testing.assert_close(out2[:5], out[:5])
    torch.testing.assert_close(out2[14:], out[14:])
    assert not torch.allclose(out2[5:14], out[5:14])


def test_rope_makes_attention_position_aware_and_relative():
    q = torch.randn(6, 2, 8, dtype=torch.float64)
    k = torch.randn(6, 2, 8, dtype=torch.float64)
    pos = torch.arange(6)
    # dot products depend only on the offset between positions
    a = (apply_rope(q, pos)[2] * apply_rope(k, pos)[4]).sum(-1)
    b = (apply_rope(q, pos + 7)[2] * apply_rope(k, pos + 7)[4]).sum(-1)
    torch.testing.assert_close(a, b)
    # without RoPE, a sequence's output is permutation-equivariant; with it, it is not
    lens, x = [6], torch.randn(6, 32, dtype=torch.float64)
    perm = torch.tensor([3, 1, 5, 0, 2, 4])
    plain = _model(rope=False)
    torch.testing.assert_close(plain(x[perm], lens), plain(x, lens)[perm])
    roped = _model()
    assert not torch.allclose(roped(x[perm], lens), roped(x, lens)[perm])


def test_attention_matches_dense_masked_attention():
    lens = [3, 4, 3, 0, 2]
    q, k, v = (torch.randn(sum(lens), 2, 4, dtype=torch.float64) for _ in range(3))
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    mask = seq[:, None] == seq[None, :]
    scores = torch.einsum("qhd,khd->hqk", q, k) / 2.0
    dense = torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, -torch.inf).softmax(-1), v)
    torch.testing.assert_close(attention(q, k, v, lens), dense)


def test_positions_restart_in_every_sequence():
    assert positions_in_sequences([3, 0, 2]).tolist() == [0, 1, 2, 0, 1]


def test_empty_rank_still_gets_zero_gradients():
    model = _model()
    out = model(torch.zeros(0, 32, dtype=torch.float64), [])
    out.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_clear_errors():
    with pytest.raises(ValueError, match="d_model=30 is not divisible by n_heads=4"):
        ToyDiT(30, 4, 1)
    with pytest.raises(ValueError, match=r"shape \(10, 32\) but seq_lens sum to 9"):
        _model()(torch.zeros(10, 32, dtype=torch.float64), [4, 5])


def test_rope_in_bfloat16_is_as_exact_as_bfloat16_at_long_positions():
    x = torch.randn(4, 2, 64, dtype=torch.float64)
    pos = torch.tensor([5, 1000, 20000, 32000])
    exact = apply_rope(x, pos)
    low = apply_rope(x.to(torch.bfloat16), pos).double()
    # a few bf16 roundings of values of order 1, at every position (an angle rounded to
    # bf16 before its cosine would be off by radians at 32k)
    assert (low - exact).abs().max() < 0.05
