"""The research code's training simulator (its ``simulator/simulate.py``), step by step
through `knapformer.compat` on gloo, with SDPA in place of flash-attention.

The calls and attributes are the simulator's, in its order: construct
``SequenceBalancer(config, gamma=gamma)``; warm-up steps (plan, route, blocks with
``pre_attn`` / ``post_attn``, ``reverse_route``, backward); a barrier;
``turn_on_tracking(n_layers, include_bwd)``; the timed steps; a barrier; on rank 0
``print_tracking_results()`` and ``sum(tracked_tflops)`` for its throughput. Its Flux
path also all-gathers the per-sample vector over ``balance_process_group`` and numbers
the tokens from ``gpu_id2seq_lens[this_gpu_id]`` / ``gpu_id2seq_ids[this_gpu_id]``
before routing them as a feature. Its experiment launcher then greps the log for
``Per GPU Capacity``, ``Original Imbalance Ratio`` and ``Balanced Imbalance Ratio``.

The harness is ours (no code of the original): a small model, a data mix of our own
(rank 0 draws the large images), CPU tensors, 4 gloo ranks.
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import knapformer.compat as compat
from knapformer.compat import SequenceBalancer  # was: from knapformer import SequenceBalancer
from knapformer.testing.dist_helpers import run_world
from knapformer.testing.log_lines import capture
from knapformer.testing.varlen_transformer import TransformerBlock, rope_cossin

WORLD, CONFIG, GAMMA = 4, "g1n2+g2n1", 1.0
D_MODEL, D_HEAD, N_LAYERS = 32, 8, 2
WARMUP, STEPS = 2, 4
LAUNCHER_LINES = ("Per GPU Capacity", "Original Imbalance Ratio", "Balanced Imbalance Ratio")


def next_batch(gen: torch.Generator, rank: int):
    """A step's data: (lengths, tokens (T, d), [RoPE (T, 2*d_head), modality (T, 1)]).
    Each sample is a prompt then an image; rank 0 draws the large images."""
    sides = (8, 12) if rank == 0 else (2, 3, 4)
    count = 2 if rank == 0 else 4
    text = torch.randint(2, 9, (count,), generator=gen)
    side = torch.tensor(sides)[torch.randint(len(sides), (count,), generator=gen)]
    lens = (text + side * side).tolist()
    modality = torch.cat(
        [torch.cat([torch.zeros(t), torch.ones(s * s)]) for t, s in zip(text, side, strict=True)]
    )
    tokens = torch.randn(sum(lens), D_MODEL, generator=gen)
    return lens, tokens, [rope_cossin(lens, D_HEAD), modality[:, None]]


class Transformer(nn.Module):
    """The simulator's plain model: blocks between route and reverse_route."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TransformerBlock(D_MODEL, D_HEAD) for _ in range(N_LAYERS))

    def forward(self, x, lens, features, balancer):
        balancer.plan_routing(lens, x.shape[-1])
        chunk_lens, x, features = balancer.route(x, features)
        for block in self.blocks:
            x = block(x, chunk_lens, features[0], balancer)
        return balancer.reverse_route(x)[:2]


class Modulated(nn.Module):
    """The simulator's Flux path: a per-sample vector ``vec (S, d)`` modulates every
    token of its sample, and a modality tag travels with the tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TransformerBlock(D_MODEL, D_HEAD) for _ in range(N_LAYERS))
        self.mod = nn.Linear(D_MODEL, D_MODEL)
        self.text_bias = nn.Parameter(torch.zeros(D_MODEL))

    def forward(self, x, lens, features, vec, balancer):
        vec = _all_gather_with_padding(vec, balancer.balance_process_group)
        balancer.plan_routing(lens, x.shape[-1])
        me = balancer.this_gpu_id
        seq_ids = torch.repeat_interleave(
            torch.tensor(balancer.gpu_id2seq_ids[me]), torch.tensor(balancer.gpu_id2seq_lens[me])
        )
        chunk_lens, x, (rope, modality, seq_ids) = balancer.route(
            x, [*features, seq_ids[:, None].float()]
        )
        scale = self.mod(vec)[seq_ids[:, 0].long()]  # (T_chunks, d): each token's sample
        text = modality[:, 0] == 0
        for block in self.blocks:
            x = block(x * (1 + scale) + text[:, None] * self.text_bias, chunk_lens, rope, balancer)
        return balancer.reverse_route(x)[:2]


def _all_gather_with_padding(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's rows of ``x (S_rank, d)``, in rank order (ranks may hold different
    counts), with gradients: what the simulator's helper of that name returns."""
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(counts, torch.tensor([x.shape[0]]), group=group)
    most = int(max(c.item() for c in counts))
    padded = torch.cat([x, x.new_zeros(most - x.shape[0], x.shape[1])])
    from torch.distributed.nn.functional import all_gather

    parts = all_gather(padded, group=group)
    return torch.cat([p[: int(c.item())] for p, c in zip(parts, counts, strict=True)])


def simulate_one_step(gen, rank, model, balancer, use_flux: bool) -> int:
    lens, x, features = next_batch(gen, rank)
    if use_flux:
        vec = torch.randn(len(lens), D_MODEL, generator=gen).requires_grad_(True)
        _, out = model(x, lens, features, vec, balancer)
    else:
        _, out = model(x, lens, features, balancer)
    out.mean().backward()
    for p in model.parameters():
        p.grad = None
    return x.shape[0]


def _simulate(rank: int, world: int, use_flux: bool) -> dict:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(rank)
    balancer = SequenceBalancer(CONFIG, gamma=GAMMA)
    model = Modulated() if use_flux else Transformer()
    for _ in range(WARMUP):
        simulate_one_step(gen, rank, model, balancer, use_flux)
    dist.barrier()
    balancer.turn_on_tracking(N_LAYERS, True)  # not skip_bwd
    lines = capture("knapformer.compat")
    start, tokens, plans = time.time(), 0, []
    for _ in range(STEPS):
        tokens += simulate_one_step(gen, rank, model, balancer, use_flux)
        plans.append(balancer.last_plan)
    dist.barrier()
    elapsed = time.time() - start
    total = torch.tensor(tokens)
    dist.all_reduce(total)
    out: dict = {"plans": plans, "tokens": int(total)}
    if rank == 0:
        lines.take()
        balancer.print_tracking_results()
        out["lines"] = lines.take()
        out["tflops"] = float(np.sum(balancer.tracked_tflops))
        out["tflops_per_s"] = out["tflops"] / elapsed
        out["tracked"] = {
            name: list(getattr(balancer, name))
            for name in (
                "tracked_per_gpu_capacity",
                "tracked_original_imbalance_ratio",
                "tracked_balanced_imbalance_ratio",
                "tracked_tflops",
            )
        }
    out["views"] = {
        name: getattr(balancer, name)
        for name in (
            "gpu_id2total_workload",
            "balance_gpu_id2total_workload",
            "orig_minmax_workload",
            "bala_minmax_workload",
            "per_gpu_capacity",
        )
    }
    out["metrics"] = dict(balancer.metrics)
    balancer.turn_off_tracking()
    out["after_off"] = (balancer.tracking, len(balancer.tracked_tflops))
    balancer.close()
    return out


def _worker(rank: int, world: int) -> dict:
    return {"plain": _simulate(rank, world, False), "flux": _simulate(rank, world, True)}


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    return run_world(_worker, WORLD, tmp_path_factory.mktemp("simulator"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("path", ["plain", "flux"])
def test_the_simulator_runs_to_the_end_and_prints_its_imbalance_lines(simulated, path):
    head = simulated[0][path]
    lines = head["lines"]
    print(f"\n[{path}] " + f"\n[{path}] ".join(lines))  # what the simulator's log shows
    assert [re.match(r"[A-Za-z /]+", line).group(0).rstrip(":") for line in lines] == list(
        LAUNCHER_LINES
    ), lines
    tracked = head["tracked"]
    # one entry per timed step, none from the warm-up
    assert all(len(values) == STEPS for values in tracked.values()), tracked
    plans = head["plans"]
    expected = {
        "tracked_per_gpu_capacity": [p.stats.mean_load for p in plans],
        "tracked_original_imbalance_ratio": [p.stats.max_min_before for p in plans],
        "tracked_balanced_imbalance_ratio": [p.stats.max_min_after for p in plans],
    }
    for (name, values), line in zip(expected.items(), lines, strict=True):
        assert tracked[name] == pytest.approx(values), name
        mean, std = (float(x) for x in re.findall(r"[-+]?\d[\d.e+-]*", line)[-2:])
        assert mean == pytest.approx(np.mean(values)) and std == pytest.approx(np.std(values))
    # the data needs balancing (rank 0 is heavy) and the balancer balanced it
    assert np.mean(expected["tracked_original_imbalance_ratio"]) > 3
    assert all(p.stats.max_min_after < p.stats.max_min_before for p in plans)
    # TFLOPs: forward, backward and a recomputation of every sequence, N_LAYERS blocks
    step_tflops = [
        sum(compat.tflops_estimator(int(n), D_MODEL, N_LAYERS, True) for n in p.sequences.length)
        for p in plans
    ]
    assert tracked["tracked_tflops"] == pytest.approx(step_tflops)
    assert head["tflops"] == pytest.approx(sum(step_tflops)) and head["tflops_per_s"] > 0
    assert head["tokens"] == sum(int(p.stats.total_tokens) for p in plans)
    for rank, res in enumerate(simulated):
        assert res[path]["after_off"] == (False, 0), rank


@pytest.mark.timeout(240)
@pytest.mark.parametrize("path", ["plain", "flux"])
def test_imbalance_attributes_are_the_last_plans(simulated, path):
    for rank, res in enumerate(simulated):
        plan, views, metrics = res[path]["plans"][-1], res[path]["views"], res[path]["metrics"]
        st = plan.stats
        gpus = [int(g) for g in plan.gpus]
        assert views["gpu_id2total_workload"] == pytest.approx(
            dict(zip(gpus, st.load_before.tolist(), strict=True))
        ), rank
        assert views["balance_gpu_id2total_workload"] == pytest.approx(
            dict(zip(gpus, st.load_after.tolist(), strict=True))
        ), rank
        assert views["orig_minmax_workload"] == pytest.approx(
            (st.load_before.min(), st.load_before.max())
        )
        assert views["bala_minmax_workload"] == pytest.approx(
            (st.load_after.min(), st.load_after.max())
        )
        assert views["per_gpu_capacity"] == pytest.approx(st.mean_load)
        # metrics: the last step's, from planning to the end of its reverse_route
        assert metrics["total_tokens"] == st.total_tokens
        assert metrics["avg_per_gpu_tokens"] == st.total_tokens / len(gpus)
        assert metrics["end_time"] >= metrics["start_time"] > 0
        assert metrics["duration_sec"] == pytest.approx(metrics["end_time"] - metrics["start_time"])
        assert metrics["route_ms"] >= 0 and metrics["plan_ms"] >= 0, sorted(metrics)
