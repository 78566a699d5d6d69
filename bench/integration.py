"""Benchmark: a diffusers transformer's training step unbalanced, with diffusers' own
context parallelism (Ulysses degree 2 and 4), and balanced, on the same batches.

Two parts, one run:

1. **Modelled** at 32 and 1,024 GPUs (the `mixres` and `joint` data mixes, d = 3072,
   gamma = 0.4, 57 layers, the `nvlink` cluster of `knapformer.planning.communication`):
   our cost model prices each strategy's step, communication included.
   - *unbalanced*: every GPU computes its own samples;
   - *diffusers CP, Ulysses g*: fixed groups of g consecutive GPUs each run the union
     of their members' samples, every sample cut into g equal parts (its length padded
     to a multiple of g: diffusers' CP needs even splits), Ulysses exchanges priced;
   - *whole samples to fixed bags* (the second design: route each sample whole to a bag,
     run diffusers' CP inside it): the planner on a fixed topology of bags of 1 to 8
     GPUs, lengths padded to a multiple of 8 (its largest bag);
   - *balanced*: the planner with ``topology="auto"`` (each step's bags), route and
     Ulysses priced (`knapformer.tools.suggest.StepCost`).
2. **Measured** on 4 CPU gloo ranks, a small random Flux (rank 0 holds two 32x32
   images, the others three 8x8): forward and backward of each rank's samples with the
   unmodified model (unbalanced, one sample at a time), with diffusers' CP (each group
   runs its members' samples one at a time; ``enable_parallelism`` on a mesh
   ``(dp, ring, ulysses)``), and balanced (``balance(model)(samples, balancer)``,
   ``g1n2+g2n1``). Step time: the slowest rank's, median over the timed steps.
3. **Packing**, one CPU process: many small samples one at a time through the
   unmodified model (what a bag of the second design runs) against packed.

    .venv/bin/python bench/integration.py [--steps 5] [--modelled-steps 3] [--small-samples 32]

On 2 shared CPU cores four processes compete for the cores, and a CPU's kernels are not
a GPU's: the measured part shows overheads and that every strategy runs, the modelled
part what to expect on GPUs. Exit 0 always (a comparison, no target).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from knapformer.planning.communication import CommModel
from knapformer.planning.datamix import MIXES, parse_mix, sample_lengths, scale_mix
from knapformer.planning.planner import plan_routing
from knapformer.planning.workload import WorkloadModel
from knapformer.testing.dist_helpers import run_world
from knapformer.tools.suggest import StepCost

D, GAMMA = 3072, 0.4
FIXED_BAGS = {32: "g1n8+g2n4+g4n2+g8n1", 1024: "g1n256+g2n128+g4n64+g8n32"}
CP_DEGREES = (2, 4)
WORLD, TOPOLOGY = 4, "g1n2+g2n1"
FLUX = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
            attention_head_dim=32, num_attention_heads=4, joint_attention_dim=32,
            pooled_projection_dim=16, axes_dims_rope=(8, 12, 12))  # fmt: skip


# ------------------------------------------------------------------ modelled part
def _padded(lengths: np.ndarray, g: int) -> np.ndarray:
    return -(-lengths // g) * g


def cp_step_ms(lengths_per_gpu: list[np.ndarray], g: int, model: WorkloadModel,
               comm: CommModel) -> float:  # fmt: skip
    """diffusers' CP with fixed groups of ``g`` GPUs: each GPU computes 1/g of every
    sample of its group (padded to a multiple of g) and exchanges its Ulysses share."""
    per_token = comm.ulysses_per_token(model.token_dim, g)
    worst = 0.0
    for start in range(0, len(lengths_per_gpu), g):
        lengths = _padded(np.concatenate(lengths_per_gpu[start : start + g]), g)
        compute = model.chunk_cost(lengths, lengths // g, np.full(len(lengths), g)).sum()
        worst = max(worst, float(compute + per_token * lengths.sum() / g))
    return float(comm.ms_of(worst)) * comm.layers


def modelled(mix: str, gpus: int, steps: int) -> dict[str, float]:
    """Mean modelled step ms of each strategy over ``steps`` sampled steps."""
    codes = parse_mix(MIXES[mix])
    codes = scale_mix(codes, gpus // sum(c.gpus for c in codes))
    model, comm = WorkloadModel(token_dim=D, gamma=GAMMA), CommModel()
    rng = np.random.default_rng(0)
    rows: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        rows.setdefault(key, []).append(value)

    for _ in range(steps):
        lengths = sample_lengths(codes, rng)
        auto = StepCost.of(plan_routing(lengths, "auto", model, comm=comm), comm)
        add("unbalanced", auto.unbalanced_ms)
        for g in CP_DEGREES:
            add(f"diffusers CP, Ulysses {g}", cp_step_ms(lengths, g, model, comm))
        fixed = plan_routing([_padded(x, 8) for x in lengths], FIXED_BAGS[gpus], model, comm=comm)
        add("whole samples to fixed bags", StepCost.of(fixed, comm).step_ms)
        add("balanced (auto)", auto.step_ms)
    return {k: statistics.mean(v) for k, v in rows.items()}


# ------------------------------------------------------------------ measured part
def _batches(rank: int, steps: int) -> list[list[dict]]:
    """This rank's samples per step: rank 0 two 32x32 images, the others three 8x8;
    every length a multiple of 4 (diffusers' CP splits evenly)."""
    gen = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(steps):
        sides = [32, 32] if rank == 0 else [8, 8, 8]
        mine = []
        for side in sides:
            lt = 4 * int(torch.randint(2, 16, (), generator=gen))
            rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
            ids = torch.stack([torch.zeros(side * side), rows.reshape(-1), cols.reshape(-1)], 1)
            mine.append(dict(hidden_states=torch.randn(1, side * side, 16, generator=gen),
                             encoder_hidden_states=torch.randn(1, lt, 32, generator=gen),
                             pooled_projections=torch.randn(1, 16, generator=gen),
                             timestep=torch.rand(1, generator=gen), img_ids=ids,
                             txt_ids=torch.zeros(lt, 3)))  # fmt: skip
        out.append(mine)
    return out


def _model():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(**FLUX)


def _timed(fn) -> float:
    import torch.distributed as dist

    dist.barrier()
    began = time.perf_counter()
    fn()
    return (time.perf_counter() - began) * 1e3


def _unbalanced(model, batch) -> None:
    for s in batch:
        model(**s).sample.square().mean().backward()


def _cp_model(g: int):
    """A model with diffusers' context parallelism over groups of ``g`` ranks."""
    from diffusers import ContextParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    torch.accelerator.device_count = lambda: 1  # diffusers divides the rank by it (0 on CPU)
    model = _model()
    mesh = init_device_mesh("cpu", (WORLD // g, 1, g), mesh_dim_names=("dp", "ring", "ulysses"))
    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=g, mesh=mesh))
    return model


def _cp(model, group_batches) -> None:
    for s in group_batches:  # every rank of the group runs each of its samples
        model(**s, return_dict=False)[0].square().mean().backward()


def _quiet() -> None:
    """diffusers' notices (CP is experimental, a deprecated collective) off the table."""
    from diffusers.utils import logging as diffusers_logging

    warnings.filterwarnings("ignore")
    diffusers_logging.set_verbosity_error()


def _worker(rank: int, world: int, steps: int) -> dict[str, list[float]]:
    import torch.distributed as dist

    from knapformer.integrations.diffusers import balance
    from knapformer.runtime.balancer import SequenceBalancer

    _quiet()
    torch.set_num_threads(1)  # the ranks share the machine's cores
    every = [_batches(r, steps) for r in range(world)]
    mine = every[rank]
    times: dict[str, list[float]] = {}
    plain = _model()
    times["unbalanced"] = [_timed(lambda b=b: _unbalanced(plain, b)) for b in mine]
    for g in CP_DEGREES:
        model = _cp_model(g)
        first = rank // g * g
        group = [[s for r in range(first, first + g) for s in every[r][i]] for i in range(steps)]
        times[f"diffusers CP, Ulysses {g}"] = [
            _timed(lambda b=b, m=model: _cp(m, b)) for b in group
        ]
    model, bal = _model(), SequenceBalancer(TOPOLOGY)
    balanced = balance(model)

    def step(batch):
        balanced(batch, bal).sum(lambda i, o: o.square().mean()).backward()

    times[f"balanced ({TOPOLOGY})"] = [_timed(lambda b=b: step(b)) for b in mine]
    bal.close()
    dist.barrier()
    return times


def measured(steps: int) -> dict[str, float]:
    """Median over the timed steps (the first warms up) of the slowest rank's step."""
    with tempfile.TemporaryDirectory() as tmp:
        per_rank = run_world(_worker, WORLD, Path(tmp), steps)
    return {
        key: statistics.median(max(r[key][s] for r in per_rank) for s in range(1, steps))
        for key in per_rank[0]
    }


def one_at_a_time_vs_packed(samples: int, repeats: int = 5) -> dict[str, float]:
    """One process: ``samples`` small samples (8x8 images, 16-token prompts) one at a time
    through the unmodified model (as inside a bag of the second design) and packed
    (``balance(model)(samples)``, no balancer): ms for forward and backward, median."""
    from knapformer.integrations.diffusers import balance

    _quiet()
    batch = [s for b in _batches(1, 1)[0:1] for s in b]
    batch = (batch * (samples // len(batch) + 1))[:samples]
    plain, packed = _model(), balance(_model())
    times: dict[str, list[float]] = {"one at a time": [], "packed": []}
    for _ in range(repeats):
        began = time.perf_counter()
        _unbalanced(plain, batch)
        times["one at a time"].append((time.perf_counter() - began) * 1e3)
        began = time.perf_counter()
        packed(batch).sum(lambda i, o: o.square().mean()).backward()
        times["packed"].append((time.perf_counter() - began) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--modelled-steps", type=int, default=3)
    parser.add_argument("--small-samples", type=int, default=32)
    args = parser.parse_args()
    console = Console(highlight=False, width=max(Console().width, 120))
    table = Table(title="modelled step time (ms, forward, all layers; x unbalanced)")
    table.add_column("strategy")
    cases = [(mix, gpus) for gpus in (32, 1024) for mix in ("mixres", "joint")]
    results = [modelled(mix, gpus, args.modelled_steps) for mix, gpus in cases]
    for mix, gpus in cases:
        table.add_column(f"{mix}, {gpus} GPUs", justify="right")
    for key in results[0]:
        table.add_row(key, *[f"{r[key]:.0f} ({r[key] / r['unbalanced']:.2f}x)" for r in results])
    console.print(table)
    times = measured(args.steps)
    console.print(f"measured: {WORLD} CPU gloo ranks, small Flux, same batches (ms per "
                        f"step, slowest rank, median of {args.steps - 1})")  # fmt: skip
    table = Table()
    table.add_column("strategy")
    table.add_column("step ms", justify="right")
    table.add_column("x unbalanced", justify="right")
    for key, ms in times.items():
        table.add_row(key, f"{ms:.0f}", f"{ms / times['unbalanced']:.2f}")
    console.print(table)
    small = one_at_a_time_vs_packed(args.small_samples)
    console.print("packing: one CPU process (ms per forward and backward, median of 5)")
    table = Table()
    for col in ("samples", "one at a time (unmodified model)", "packed (balance, no balancer)",
                "x packed"):  # fmt: skip
        table.add_column(col, justify="right")
    one, packed = small["one at a time"], small["packed"]
    table.add_row(f"{args.small_samples} x 8x8 images", f"{one:.0f}", f"{packed:.0f}",
                  f"{one / packed:.2f}")  # fmt: skip
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
