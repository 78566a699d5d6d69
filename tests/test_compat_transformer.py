"""The research code's own test (its ``tests/test_transformer.py``) ported to gloo on CPU.

The flow and the checks are the original's: on 8 ranks with bags ``g1n2+g2n1+g4n1``,
plan, ``print_imbalance()``, route tokens and features and route them back
(``(seq_lens == this_gpu_seq_lens).all()`` and equal data); then one transformer block,
forward and backward, without and with the balancer (equal lengths, outputs and
gradients). The balancer is imported the way a user of the research code switches to
this package: that import is the only line of balancer code that differs.

What differs is the harness: real gloo processes (``run_world``) and CPU tensors instead
of torchrun and CUDA; a small model and lengths scaled by 1/16 (the same mix per rank);
data from a seeded generator instead of a broadcast; results checked in the test process.
The block check runs in float64 with every weight random and a random probe in the loss:
the original zero-initialises the residual outputs and takes a mean, which leaves its
outputs equal to its inputs and its gradients near 1e-8, below any tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from knapformer.compat import SequenceBalancer  # was: from knapformer import SequenceBalancer
from knapformer.testing.dist_helpers import run_world
from knapformer.testing.log_lines import capture
from knapformer.testing.varlen_transformer import TransformerBlock, rope_cossin

WORLD = 8
BAG_SPECS = "g1n2+g2n1+g4n1"
D_MODEL, D_HEAD, D_FEATURE = 64, 16, 8  # 4 heads: whole heads for every bag of up to 4 GPUs

# The original's token-length ranges, divided by 16, and its data per rank.
TEXT_RANGE = (4, 16)
IMAGE_RANGES = {256: (14, 18), 512: (55, 72), 1024: (220, 286), 2048: (880, 1144)}
GPU_DATA = {
    0: (32, 256),
    1: (32, 256),
    2: (8, 512),
    3: (2, 1024),
    4: (1, 256),
    5: (1, 256),
    6: (1, 256),
    7: (1, 2048),
}


def create_transformer_block(d_model: int, d_head: int) -> TransformerBlock:
    torch.manual_seed(0)  # the same weights on every rank
    return TransformerBlock(d_model, d_head)


def create_sequences(
    d_model: int,
    d_head: int,
    d_feature: int,
    token_dtype: torch.dtype,
    feature_dtype: torch.dtype,
    seed: int,
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor], dict[int, list[torch.Tensor]]]:
    """Every rank's lengths (int64 tensors), packed tokens and features [RoPE, other]."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens, packed_seqs, packed_features = {}, {}, {}
    for gpu_id, (num_seqs, resolution) in GPU_DATA.items():
        text = torch.randint(TEXT_RANGE[0], TEXT_RANGE[1] + 1, (num_seqs,), generator=gen)
        low, high = IMAGE_RANGES[resolution]
        lens = text + torch.randint(low, high + 1, (num_seqs,), generator=gen)
        total = int(lens.sum())
        seq_lens[gpu_id] = lens
        packed_seqs[gpu_id] = (0.02 * torch.randn(total, d_model, generator=gen)).to(token_dtype)
        packed_features[gpu_id] = [
            rope_cossin(lens, d_head),
            (0.02 * torch.randn(total, d_feature, generator=gen)).to(feature_dtype),
        ]
    return seq_lens, packed_seqs, packed_features


def check_route_and_reverse_route(sequence_balancer, seq_lens, packed_seqs, packed_features):
    this_gpu_id = dist.get_rank()
    this_gpu_seq_lens = seq_lens[this_gpu_id]
    this_gpu_packed_seqs = packed_seqs[this_gpu_id]
    this_gpu_packed_features = packed_features[this_gpu_id]

    lines = capture("knapformer.compat")
    sequence_balancer.plan_routing(this_gpu_seq_lens, this_gpu_packed_seqs.shape[-1])
    sequence_balancer.print_imbalance()

    bala_chunk_lens, bala_seqs, bala_features = sequence_balancer.route(
        this_gpu_packed_seqs, this_gpu_packed_features
    )
    lens, seqs, features = sequence_balancer.reverse_route(bala_seqs, bala_features)
    result = {
        "lens_equal": bool((lens == this_gpu_seq_lens).all().item()),
        "seqs_equal": torch.equal(seqs, this_gpu_packed_seqs),
        "features_equal": [
            torch.equal(a, b) for a, b in zip(features, this_gpu_packed_features, strict=True)
        ],
        "routed_rows": (sum(bala_chunk_lens), bala_seqs.shape[0]),
        "imbalance_lines": lines.lines,
        "plan": sequence_balancer.last_plan,
    }
    dist.barrier()
    return result


def check_transformer_block_forward_backward(
    sequence_balancer, transformer_block, seq_lens, packed_seqs, packed_features
):
    this_gpu_id = dist.get_rank()
    this_gpu_packed_seqs = packed_seqs[this_gpu_id]
    this_gpu_seq_lens = seq_lens[this_gpu_id]
    this_gpu_packed_features = packed_features[this_gpu_id]
    probe = torch.randn(
        this_gpu_packed_seqs.shape,
        generator=torch.Generator().manual_seed(this_gpu_id),
        dtype=this_gpu_packed_seqs.dtype,
    )
    this_gpu_packed_seqs.requires_grad = True
    params = list(transformer_block.parameters())

    # ---------- without sequence balancer
    out_without = transformer_block(
        this_gpu_packed_seqs, this_gpu_seq_lens, this_gpu_packed_features[0]
    )
    (out_without * probe).sum().backward()
    grads_without = [this_gpu_packed_seqs.grad.clone()] + [p.grad.clone() for p in params]

    # ---------- with sequence balancer
    this_gpu_packed_seqs.grad = None
    for p in params:
        p.grad = None
    sequence_balancer.plan_routing(this_gpu_seq_lens, this_gpu_packed_seqs.shape[-1])
    bala_chunk_lens, bala_seqs, bala_features = sequence_balancer.route(
        this_gpu_packed_seqs, this_gpu_packed_features
    )
    bala_seqs = transformer_block(bala_seqs, bala_chunk_lens, bala_features[0], sequence_balancer)
    lens, out_with, _ = sequence_balancer.reverse_route(bala_seqs)
    (out_with * probe).sum().backward()
    grads_with = [this_gpu_packed_seqs.grad.clone()] + [p.grad.clone() for p in params]

    # A rank's weights see the tokens routed to it, not its own: compare the sums over
    # ranks, which are what a data-parallel step applies.
    for grads in (grads_with[1:], grads_without[1:]):
        for g in grads:
            dist.all_reduce(g)
    result = {
        "lens_equal": bool((lens == this_gpu_seq_lens).all().item()),
        "out_close": torch.allclose(out_with, out_without),
        "out_max_diff": float((out_with - out_without).detach().abs().max()),
        "grads_close": [
            torch.allclose(a, b) for a, b in zip(grads_with, grads_without, strict=True)
        ],
        "plan": sequence_balancer.last_plan,
    }
    dist.barrier()
    return result


def _original_flow(rank: int, world: int) -> dict:
    sequence_balancer = SequenceBalancer(BAG_SPECS)
    data = create_sequences(D_MODEL, D_HEAD, D_FEATURE, torch.bfloat16, torch.float32, seed=1)
    routed = check_route_and_reverse_route(sequence_balancer, *data)

    data = create_sequences(D_MODEL, D_HEAD, D_FEATURE, torch.float64, torch.float32, seed=2)
    block = create_transformer_block(D_MODEL, D_HEAD).to(torch.float64)
    trained = check_transformer_block_forward_backward(sequence_balancer, block, *data)
    sequence_balancer.close()
    return {"route": routed, "block": trained}


def _split_across_gpus(plan) -> int:
    """Sequences whose chunks land on more than one GPU (Ulysses was exercised)."""
    dst_per_seq: dict[int, set[int]] = {}
    for s, d in zip(plan.chunks.seq.tolist(), plan.chunks.dst_gpu.tolist(), strict=True):
        dst_per_seq.setdefault(s, set()).add(d)
    return sum(len(d) > 1 for d in dst_per_seq.values())


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_original_test_flow_passes_through_compat(tmp_path):
    results = run_world(_original_flow, WORLD, tmp_path)
    for rank, res in enumerate(results):
        routed, block = res["route"], res["block"]
        assert routed["lens_equal"] and routed["seqs_equal"], rank
        assert routed["features_equal"] == [True, True], rank
        assert routed["routed_rows"][0] == routed["routed_rows"][1], rank
        assert block["lens_equal"], rank
        assert block["out_close"], (rank, block["out_max_diff"])
        assert all(block["grads_close"]), (rank, block["grads_close"])
        # print_imbalance logged the current plan's max/min figures on every rank
        st = routed["plan"].stats
        assert routed["imbalance_lines"][-1].endswith(
            f"{st.max_min_before:.4f} -> {st.max_min_after:.4f}"
        ), routed["imbalance_lines"]
    for key in ("route", "block"):
        plan = results[0][key]["plan"]
        # the data really needs balancing: sequences moved and some were split by Ulysses
        assert plan.solver == "greedy" and plan.gamma == 1.0
        assert plan.stats.moved_tokens > 0 and _split_across_gpus(plan) > 0
        assert plan.stats.max_min_after < plan.stats.max_min_before
        assert all(
            np.array_equal(r[key]["plan"].chunks.dst_gpu, plan.chunks.dst_gpu) for r in results
        )
