"""Benchmark: what a balanced training step of a diffusers model costs over the
unbalanced one, on CPU gloo processes.

Per model (diffusers' Flux and Wan, small random configs; rank 0 draws the large images
or videos), every rank runs, in each step, forward + backward of the same samples twice:

- **unbalanced**: ``BalancedFlux(model)(batch)`` / ``BalancedWan(model)(batch)`` with no
  balancer: each rank computes its own samples where they are;
- **balanced**: ``plan_routing`` then the same call with the balancer.

From the balanced step the balancer's own timings (`SequenceBalancer.timings`, which time
the backward exchanges too) take out planning (``plan``, the length all-gather
included), the route (``route`` + ``reverse_route``) and the Ulysses exchanges
(``pre_attn`` + ``post_attn``); what is left is the model's own compute in that step.
Each is shown against that compute, on the rank that computes most (the critical path).
Collective times include waiting for the peers that arrive later, so they are shown on
the rank that waited least in them (closest to the transfer itself) and as the mean over
the ranks that ran them. Step times are the slowest rank's; every figure is the median
over the timed steps (the first is a warm-up).

On 2 shared CPU cores the 4 processes compete for the same cores, so the balanced step
is not expected to be faster here: the figures to read are the overheads.

    .venv/bin/python bench/integration.py [--steps 6] [--world 4]

Targets (exit 1 when missed): planning takes at most 25% of the model's compute and the
route (the rank that waited least) at most 50%: both cost a few ms per step whatever the
model, and these models are tiny; on a real model both shrink towards nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from knapformer.testing.dist_helpers import run_world

PLAN_TARGET, ROUTE_TARGET = 0.25, 0.50
PHASES = {
    "plan": ("plan",),
    "route": ("route", "reverse_route"),
    "ulysses": ("pre_attn", "post_attn"),
}

FLUX = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
            attention_head_dim=32, num_attention_heads=4, joint_attention_dim=32,
            pooled_projection_dim=16, axes_dims_rope=(8, 12, 12))  # fmt: skip
WAN = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32, in_channels=8,
           out_channels=8, text_dim=32, freq_dim=32, ffn_dim=256, num_layers=2,
           cross_attn_norm=True, rope_max_seq_len=64)  # fmt: skip
TOPOLOGY = {4: "g1n2+g2n1", 8: "g1n2+g2n1+g4n1"}


def _flux(rank: int, gen: torch.Generator):
    """(model, batch maker) for Flux: rank 0 two 32x32 images, the others three small."""
    from diffusers import FluxTransformer2DModel

    from knapformer.integrations.diffusers import BalancedFlux, FluxBatch

    torch.manual_seed(0)
    model = FluxTransformer2DModel(**FLUX)

    def batch():
        sides = [32, 32] if rank == 0 else [8, 6, 8]
        imgs, txts, iids, tids = [], [], [], []
        for side in sides:
            lt = int(torch.randint(8, 64, (), generator=gen))
            imgs.append(torch.randn(side * side, 16, generator=gen))
            txts.append(torch.randn(lt, 32, generator=gen))
            grid = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side),
                                              indexing="ij"), -1).reshape(-1, 2)  # fmt: skip
            iids.append(torch.cat([torch.zeros(side * side, 1), grid], 1).float())
            tids.append(torch.zeros(lt, 3))
        n = len(sides)
        b = FluxBatch.pack(imgs, txts, torch.randn(n, 16, generator=gen),
                           torch.rand(n, generator=gen), iids, tids)  # fmt: skip
        return b, b.seq_lens

    return model, BalancedFlux(model), batch, 128


def _wan(rank: int, gen: torch.Generator):
    """(model, batch maker) for Wan: rank 0 one 8x16x16 video, the others two small."""
    from diffusers import WanTransformer3DModel

    from knapformer.integrations.diffusers import BalancedWan, WanBatch

    torch.manual_seed(0)
    model = WanTransformer3DModel(**WAN)
    balanced = BalancedWan(model)

    def batch():
        shapes = [(8, 16, 16)] if rank == 0 else [(2, 8, 8), (1, 8, 8)]
        lats = [torch.randn(8, *s, generator=gen) for s in shapes]
        n = len(shapes)
        b = WanBatch(
            lats, torch.rand(n, generator=gen) * 1000, torch.randn(n, 16, 32, generator=gen)
        )
        return b, b.seq_lens(balanced.patch_size)

    return model, balanced, batch, 128


MODELS = {"Flux": _flux, "Wan": _wan}


def _worker(rank: int, world: int, name: str, steps: int) -> list[dict]:
    import torch.distributed as dist

    from knapformer.runtime.balancer import SequenceBalancer

    torch.set_num_threads(1)  # the processes share the machine's cores
    gen = torch.Generator().manual_seed(rank)
    model, balanced, make_batch, d = MODELS[name](rank, gen)
    bal = SequenceBalancer(TOPOLOGY[world])
    rows = []
    for _ in range(steps):
        batch, lens = make_batch()
        dist.barrier()
        began = time.perf_counter()
        balanced(batch, None).square().mean().backward()
        unbalanced = (time.perf_counter() - began) * 1e3
        model.zero_grad(set_to_none=True)
        dist.barrier()
        began = time.perf_counter()
        bal.plan_routing(lens, d)
        balanced(batch, bal).square().mean().backward()
        step = (time.perf_counter() - began) * 1e3
        timings = bal.timings
        model.zero_grad(set_to_none=True)
        row = {"unbalanced": unbalanced, "balanced": step}
        for key, phases in PHASES.items():
            row[key] = sum(timings.get(p, 0.0) for p in phases)
        row["compute"] = step - sum(row[k] for k in PHASES)
        rows.append(row)
    bal.close()
    return rows


def measure(name: str, world: int, steps: int) -> dict[str, float]:
    """Median over the timed steps of: the slowest rank's step times; planning and the
    model's compute on the rank that computes most (the critical path); the route and
    the Ulysses exchanges on the rank that waited least in them (closest to the transfer
    itself) and their mean over the ranks that ran them."""
    with tempfile.TemporaryDirectory() as tmp:
        per_rank = run_world(_worker, world, Path(tmp), name, steps)
    out: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        out.setdefault(key, []).append(value)

    for s in range(1, steps):  # step 0 warms up
        rows = [r[s] for r in per_rank]
        critical = max(rows, key=lambda r: r["compute"])
        add("unbalanced", max(r["unbalanced"] for r in rows))
        add("balanced", max(r["balanced"] for r in rows))
        add("compute", critical["compute"])
        add("plan", critical["plan"])
        for key in ("route", "ulysses"):
            ran = [r[key] for r in rows if r[key] > 0] or [0.0]
            add(key, min(ran))
            add(f"{key}_mean", statistics.mean(ran))
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--world", type=int, choices=sorted(TOPOLOGY), default=4)
    args = parser.parse_args()
    console = Console(highlight=False, width=max(Console().width, 140))
    table = Table(
        title=f"balanced vs unbalanced training step, {args.world} CPU gloo ranks, "
        f"{TOPOLOGY[args.world]} (ms, median of {args.steps - 1} steps)"
    )
    for col in ("model", "unbalanced step", "balanced step", "model compute", "planning",
                "route", "route (mean)", "Ulysses", "Ulysses (mean)"):  # fmt: skip
        table.add_column(col, justify="right")
    ok = True
    for name in MODELS:
        m = measure(name, args.world, args.steps)
        compute = m["compute"]

        def share(key: str, m=m, compute=compute) -> str:
            return f"{m[key]:.1f} ({m[key] / compute:.0%})"

        table.add_row(name, f"{m['unbalanced']:.1f}", f"{m['balanced']:.1f}",
                      f"{compute:.1f}", share("plan"), share("route"), share("route_mean"),
                      share("ulysses"), share("ulysses_mean"))  # fmt: skip
        ok &= m["plan"] <= PLAN_TARGET * compute and m["route"] <= ROUTE_TARGET * compute
    console.print(table)
    console.print(
        "steps: the slowest rank's. compute and planning: the rank that computes most (the "
        "step minus planning, route and Ulysses). route, Ulysses: the rank that waited "
        "least in them, and the mean over the ranks that ran them; waiting for later "
        "peers included. % of that compute. "
        f"Targets: planning <= {PLAN_TARGET:.0%}, route <= {ROUTE_TARGET:.0%}: "
        + ("[green]met[/green]" if ok else "[red]missed[/red]")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
