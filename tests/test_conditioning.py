"""Per-sequence data after route (knapformer/runtime/conditioning.py) on 4 gloo ranks."""

from __future__ import annotations

import pytest
import torch

from knapformer.testing.dist_helpers import run_world

# Rank 0 much heavier (its long sequence is split), rank 2 holds no sequence.
LENGTHS = [[300, 7, 0, 40], [5], [], [12, 9]]


def _worker(rank: int, world: int) -> dict:
    from knapformer.errors import KnapformerError
    from knapformer.runtime.balancer import SequenceBalancer

    bal = SequenceBalancer("g1n2+g2n1")
    lens = LENGTHS[rank]
    bal.plan_routing(lens, 16)
    # the global id of each sequence, as every rank can number them: (rank, index)
    tag = torch.tensor([rank * 100 + i for i in range(len(lens))], dtype=torch.float64)
    per_token_tag = torch.repeat_interleave(tag, torch.tensor(lens, dtype=torch.int64))
    _, _, routed_tag = bal.route(torch.zeros(sum(lens), 4), per_token_tag)
    x = tag[:, None].repeat(1, 3).requires_grad_()
    rows = bal.per_token(x)  # (T_chunks, 3)
    weights = torch.arange(rows.shape[0], dtype=torch.float64)[:, None] % 5
    (rows * weights).sum().backward()
    # what each token's weight adds up to at home, routed back the plain way
    _, w_home, _ = bal.reverse_route(weights.expand(-1, 3).contiguous())
    expected = torch.zeros(len(lens), 3, dtype=torch.float64)
    seq_of_token = torch.repeat_interleave(
        torch.arange(len(lens)), torch.tensor(lens, dtype=torch.int64)
    )
    expected.index_add_(0, seq_of_token, w_home)
    plan = bal.last_plan
    index = bal.sequence_index()
    src = torch.as_tensor(plan.sequences.src_gpu, dtype=torch.int64)[index]
    try:
        bal.gather_sequences(torch.zeros(len(lens) + 1, 2))
        error = ""
    except KnapformerError as err:
        error = str(err)
    out = {
        "rows_match": torch.equal(rows[:, 0].detach(), routed_tag),
        "grad": torch.allclose(x.grad, expected),
        "index_src_ok": torch.equal(src, torch.div(routed_tag, 100, rounding_mode="floor").long()),
        "tokens": rows.shape[0],
        "error": error,
        "gathered": bal.gather_sequences(tag).tolist(),
    }
    bal.close()
    return out


@pytest.mark.timeout(120)
def test_per_sequence_rows_reach_their_tokens_and_gradients_go_home(tmp_path):
    results = run_world(_worker, 4, tmp_path)
    every = [r * 100 + i for r, lens in enumerate(LENGTHS) for i in range(len(lens))]
    for rank, r in enumerate(results):
        assert r["rows_match"], f"rank {rank}: a token got another sequence's row"
        assert r["grad"], f"rank {rank}: gradients did not come home summed"
        assert r["index_src_ok"], f"rank {rank}: sequence_index names another sequence"
        assert f"gave plan_routing {len(LENGTHS[rank])} sequences" in r["error"], r["error"]
        assert r["gathered"] == every  # plan sequence order: by rank, then as given
    assert sum(r["tokens"] for r in results) == sum(map(sum, LENGTHS))
