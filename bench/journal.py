"""Benchmark: what the step journal and the roll call (knapformer/runtime/journal.py,
roll_call.py) cost a training step, against the same loop without them, in the same run.

Eight gloo processes on the CPU train the demo's ToyDiT (topology g1n2+g2n1+g4n1, the
demo's data mix and sizes) through a `SequenceBalancer` with per-sequence conditioning,
in triples of steps on one batch: with the journal, without it (its calls replaced by
no-ops: no entry, no status written), and without it again (a control: how much two
identical steps differ on this machine). A step's time is the slowest rank's, from
``plan_routing`` to the end of the gradient all-reduce; the journal's share is the median
over the batches of (journaled / the mean of the two unjournaled steps) - 1, and the
median of (control / not) - 1 says how finely the machine can tell. The watcher thread,
which runs either way, is measured by its own CPU clock. Then, in one process, the cost
of one journaled collective on the host (entering and leaving a journal entry around a
call), which is what a GPU job pays per collective: the host launches NCCL work and moves on. Target
(printed PASS or FAIL, exit 1 when missed): at 8 ranks, the journal costs at most 1 % of
the step.

    .venv/bin/python bench/journal.py [--steps 100]
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from footer import print_load, print_targets
from rich.console import Console

from knapformer.local.launcher import TRAINING_PRELOAD, launch

WORLD, TOPOLOGY = 8, "g1n2+g2n1+g4n1"
TARGET = 0.01  # the journal's share of a step, at most


_ON = [True]  # whether this process journals the current step


def _switchable() -> None:
    """Make the roll call's per-step work follow `_ON` (this process only)."""
    from knapformer.runtime import roll_call

    collective, started = roll_call.RollCall.collective, roll_call.RollCall.step_started
    roll_call.RollCall.collective = lambda self, *a, **k: (
        collective(self, *a, **k) if _ON[0] else nullcontext()
    )
    roll_call.RollCall.step_started = lambda self: started(self) if _ON[0] else None


def _watcher_cpu_ms(bal) -> float:
    """CPU ms the roll call's watcher thread has run so far."""
    clock = time.pthread_getcpuclockid(bal._watch._watcher.ident)
    return time.clock_gettime(clock) * 1e3


MODES = ("on", "off", "control")  # the control is a second step without the journal


def _worker(rank: int, world: int, steps: int) -> dict:
    """The demo's loop in triples of steps on one batch: journaled, not, and not again (the
    control), so that the three see the same data and the same machine, in an order that
    turns from batch to batch (no mode is always first); each step's ms, the slowest
    rank's."""
    import numpy as np

    from knapformer.local.config import DemoConfig
    from knapformer.local.models import ToyDiT
    from knapformer.planning.datamix import sample_lengths
    from knapformer.runtime.balancer import SequenceBalancer

    _switchable()
    cfg = DemoConfig(world_size=WORLD, topology=TOPOLOGY)
    d_model, heads = cfg.model_dims
    torch.manual_seed(0)
    model = ToyDiT(d_model, heads, cfg.n_layers)
    params = list(model.parameters())
    bal = SequenceBalancer(TOPOLOGY)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    began, entries = time.perf_counter(), 0
    for step in range(3 * (steps + 1)):
        batch, turn = divmod(step, 3)
        mode = MODES[(turn + batch) % 3]  # each mode takes each place in turn
        _ON[0] = mode == "on"
        started, before = time.perf_counter(), bal.journal.count
        rng = np.random.default_rng([batch, rank])
        lengths = sample_lengths([cfg.codes[rank]], rng, cfg.length_scale)[0]
        bal.plan_routing(lengths, token_dim=d_model)
        x = torch.randn(int(lengths.sum()), d_model)
        cond = bal.per_token(torch.randn(len(lengths), 4, requires_grad=True))
        (model(x, lengths.tolist(), bal).square().mean() + cond.sum()).backward()
        bal.all_reduce(torch.cat([p.grad.reshape(-1) for p in params]))
        for p in params:
            p.grad = None
        if step >= 3:  # the first triple warms up
            times[mode].append((time.perf_counter() - started) * 1e3)
            entries = max(entries, bal.journal.count - before)
    watcher = _watcher_cpu_ms(bal) / (time.perf_counter() - began)
    _ON[0] = True
    bal.close()
    out = {}
    for mode, values in times.items():
        slowest = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        out[mode] = slowest.tolist()
    return out | {"entries": entries, "watcher_ms_per_s": watcher}


def per_collective_us(n: int = 200_000) -> tuple[float, float]:
    """µs per journaled collective on the host (an empty call inside the journal's
    ``with`` block), and per bare ``with nullcontext()`` for comparison."""
    from knapformer.runtime.journal import Journal
    from knapformer.runtime.roll_call import _InCollective

    journal = Journal(0)

    class Owner:  # the journal's side of a RollCall, without a store
        pass

    owner = Owner()
    owner.journal = journal
    ranks = list(range(8))
    began = time.perf_counter()
    for _ in range(n):
        with _InCollective(owner, "route", -1, ranks, False, None):
            pass
    journaled = (time.perf_counter() - began) / n * 1e6
    began = time.perf_counter()
    for _ in range(n):
        with nullcontext():
            pass
    bare = (time.perf_counter() - began) / n * 1e6
    return journaled, bare


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="batches, three steps each")
    args = parser.parse_args()
    console = Console(highlight=False)
    results = launch(_worker, WORLD, (args.steps,), preload=TRAINING_PRELOAD)
    on, off, control = (results[0][mode] for mode in MODES)
    med_on, med_off = statistics.median(on), statistics.median(off)
    # Against both unjournaled steps of the batch; the two differ by the machine's noise.
    unjournaled = [(b + c) / 2 for b, c in zip(off, control, strict=True)]
    share = statistics.median(a / u for a, u in zip(on, unjournaled, strict=True)) - 1
    noise = statistics.median(c / b for c, b in zip(control, off, strict=True)) - 1
    watcher = max(r["watcher_ms_per_s"] for r in results)
    journaled, bare = per_collective_us()
    entries = max(r["entries"] for r in results)
    console.print(f"{WORLD} gloo ranks, {TOPOLOGY}, the demo's ToyDiT and data; {len(on)} "
                  "batches, each trained journaled, then not, then not again")  # fmt: skip
    console.print(f"{'':<26}{'median step (ms)':>18}{'steps':>7}")
    console.print(f"{'journal on':<26}{med_on:>18.2f}{len(on):>7}")
    console.print(f"{'journal off':<26}{med_off:>18.2f}{len(off):>7}")
    console.print(f"{'not again (control)':<26}{statistics.median(control):>18.2f}"
                  f"{len(control):>7}")  # fmt: skip
    console.print(f"journal's share of a step, median over batches: {share:+.2%} (the two "
                  f"unjournaled steps of a batch differ by {noise:+.2%})")  # fmt: skip
    console.print(f"entries per step (the most of any rank): {entries}; one journaled "
                  f"collective on the host: {journaled:.2f} µs (a bare with-block: {bare:.2f} "
                  f"µs), {entries * journaled / 1e3:.3f} ms per step; the watcher thread: "
                  f"{watcher:.2f} ms of CPU per second")  # fmt: skip
    print_load(console)
    return print_targets(
        console,
        [
            (
                f"the journal costs ≤ {TARGET:.0%} of a step at {WORLD} ranks ({share:+.2%})",
                share <= TARGET,
            )
        ],
    )


if __name__ == "__main__":
    raise SystemExit(main())
