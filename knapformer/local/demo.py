"""The live training demo behind ``knapformer demo`` / ``make demo``.

``run_demo`` starts one CPU worker process per rank on a gloo process group. The workers
train `knapformer.local.models.ToyDiT` with a `SequenceBalancer` on a synthetic data mix (a
flow-matching loss on tokens that share a per-sequence latent, so attention has something
to learn), take an optimizer step every step and record every plan with a `PlanRecorder`:
every step to the run store ``<out>/store/``, every ``every``-th full plan to
``<out>/plans.jsonl``. Rank 0 sends one `StepReport` per step to the launcher, which
prints it and, unless told not to, serves the dashboard on the same file.

Fault injection: ``slow_rank`` loses ``(slow_factor - 1)`` times its measured compute
every step (`knapformer.local.slowdown`), where ``slow_kind`` says: as compute (``gpu``),
as host work (``host``), as a late batch (``input``: the loop times making each batch as
the ``data`` phase) or inside its token exchanges (``link``). Its peers wait for it, and
the balancer's measurements show where the slow rank's time went and their waiting.
``cost_model="history"`` makes the balancer learn the speeds and give the slow rank less
work; ``plan_ahead`` prefetches each next step's plan while the current one trains.
``fault`` (``--fail-rank``, `knapformer.local.faults`) makes one rank raise, stall, die or
give a tensor of the wrong shape at one step: every other rank names it, and the run's
``incident.json`` records it.

Stopping: `knapformer.local.launcher` owns the workers. Ctrl-C (SIGINT) reaches the
launcher, which sets the stop flag: the workers carry it in their gradient all-reduce, so
all of them leave after the same step and close their recorders (every queued plan is
written). Whatever still runs after a grace period gets SIGTERM (which also flushes the
recorder), then SIGKILL. A worker that dies, raises or stalls is named, once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from knapformer.contract.incident import remove_incident
from knapformer.contract.phases import DATA, FORWARD_BACKWARD, HOST, OPTIMIZER
from knapformer.contract.runfiles import plans_file, remove_recording
from knapformer.contract.stats import summary_line
from knapformer.errors import file_error
from knapformer.local.config import (
    DEMO_CODES,
    HEAD_DIM,
    LENGTH_SCALE,
    DemoConfig,
    default_topology,
    model_shape,
    rank_codes,
    topology_note,
)
from knapformer.local.launcher import (
    TRAINING_PRELOAD,
    launch,
    report_progress,
    send,
    stop_requested,
)
from knapformer.runtime.roll_call import ANSWER_S
from knapformer.runtime.store_files import remove_stores

# The configuration lives in the torch-free knapformer.local.config; its names are
# importable from here as well.
__all__ = [
    "DEMO_CODES",
    "HEAD_DIM",
    "LENGTH_SCALE",
    "DemoConfig",
    "StepReport",
    "default_topology",
    "format_report",
    "model_shape",
    "rank_codes",
    "run_demo",
    "topology_note",
    "train",
]

#: Bytes each way of the demo's link probe: well under a millisecond a round on CPU gloo.
DEMO_PROBE_BYTES = 2**18
_LATENT_RANK = 8  # tokens of a sequence are noisy views of one latent of this size
_GRACE_S = 5.0  # Ctrl-C -> SIGTERM -> SIGKILL
_STALL_S = 30.0  # no rank starts a step for this long: name the one to blame


@dataclass
class StepReport:
    """One training step as rank 0 saw it."""

    step: int
    loss: float
    imbalance_before: float  # max/mean GPU load of the balance group
    imbalance_after: float
    moved_tokens: int
    tokens: int  # tokens of the balance group this step
    step_ms: float  # rank 0's wall time from planning to the end of the optimizer step
    times: dict[str, float] = field(default_factory=dict)  # rank 0's phases (ms)


def format_report(r: StepReport) -> str:
    return (
        f"step {r.step:>4}  loss {r.loss:7.4f}  "
        f"{summary_line(r.imbalance_before, r.imbalance_after, r.moved_tokens, r.tokens)}  "
        f"{r.step_ms:.1f} ms"
    )


# ------------------------------------------------------------------------ launcher
def prepare_out(cfg: DemoConfig) -> None:
    """Create the output folder and remove an earlier run's incident and, when recording,
    its recording (its steps restart at 0: a fresh file). Call it before serving the
    folder, so that a reader never sees the old run (`run_demo` calls it too)."""
    out = Path(cfg.out)  # cfg checked itself when it was made
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise file_error(out, err, "cannot create the folder") from err
    if cfg.record:
        remove_recording(plans_file(out))
        remove_stores(out)
    remove_incident(out)  # an earlier run's failure is not this one's


def run_demo(
    cfg: DemoConfig,
    on_report: Callable[[StepReport], None] | None = None,
    on_start: Callable[[], None] | None = None,
) -> list[StepReport]:
    """Train with ``cfg.world_size`` worker processes; returns rank 0's reports.

    ``on_report`` sees each step as it finishes. Raises `WorkerFailed` naming the rank
    when a worker dies, raises or stalls, ``KeyboardInterrupt`` on Ctrl-C (the workers
    finish the same step first); either way every worker is stopped first.
    """
    prepare_out(cfg)
    reports: list[StepReport] = []

    def relay(rank: int, report: StepReport) -> None:
        reports.append(report)
        if on_report is not None:
            on_report(report)

    launch(
        _worker,
        cfg.world_size,
        (cfg,),
        on_message=relay,
        on_start=on_start,
        # The balancers name a rank that stalls within their timeout: let them say it.
        stall_s=max(_STALL_S, cfg.group_timeout + ANSWER_S + 10),
        grace_s=_GRACE_S,
        preload=TRAINING_PRELOAD,
        group_timeout_s=cfg.group_timeout,
        settle_s=ANSWER_S + 5,
    )
    return reports


# -------------------------------------------------------------------------- worker
def _worker(rank: int, world: int, cfg: DemoConfig) -> None:
    train(rank, cfg, send if rank == 0 else None, stop_requested)


def train(
    rank: int,
    cfg: DemoConfig,
    report: Callable[[StepReport], None] | None = None,
    stop: Callable[[], bool] | None = None,
) -> None:
    """The training loop of one rank (process group already initialised).

    ``stop()``: once it is true on any rank, all ranks finish that step and return.
    """
    import numpy as np
    import torch

    from knapformer.local.models import ToyDiT
    from knapformer.planning.datamix import sample_lengths
    from knapformer.runtime.balancer import SequenceBalancer
    from knapformer.runtime.recorder import PlanRecorder

    topo, codes = cfg.parsed_topology, cfg.codes
    d_model, n_heads = cfg.model_dims
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = ToyDiT(d_model, n_heads, cfg.n_layers)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr)
    mixing = torch.randn(_LATENT_RANK, d_model) / math.sqrt(_LATENT_RANK)
    recorder = (
        PlanRecorder(plans_file(cfg.out), every=cfg.every, store_segment_steps=cfg.segment_steps)
        if cfg.record
        else None
    )
    options = {"recorder": recorder, "run": cfg.run, "cost_model": cfg.cost_model}
    options["plan_ahead"] = cfg.plan_ahead
    options |= {"link_probe_every": cfg.link_probe_every, "link_probe_bytes": DEMO_PROBE_BYTES}
    options["time_gc"] = True  # workers leave by the launcher's flag, not by Ctrl-C
    if cfg.auto:
        options["node_size"] = cfg.node_size
    kind: type[SequenceBalancer] = SequenceBalancer
    if cfg.slow_rank == rank:
        from knapformer.local.slowdown import SlowBalancer

        kind = SlowBalancer
        options |= {"slow_factor": cfg.slow_factor, "slow_kind": cfg.slow_kind}
    if cfg.fault is not None and cfg.fault.rank == rank:
        from knapformer.local.faults import faulty

        kind = faulty(kind)
        options["fault"] = cfg.fault
    balancer = kind(topo, **options)

    def batch(step: int):
        rng = np.random.default_rng([cfg.seed, step, rank])
        lengths = sample_lengths([codes[rank]], rng, cfg.length_scale)[0]
        return lengths, int(rng.integers(2**62))

    profiler = None
    if cfg.profile is not None:  # after init_process_group: the trace names its rank
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        handler = torch.profiler.tensorboard_trace_handler(str(cfg.profile))
        profiler = torch.profiler.profile(activities=activities, on_trace_ready=handler)
        profiler.start()
    try:
        step = 0
        while cfg.steps == 0 or step < cfg.steps:
            report_progress(step)  # the launcher's watchdog names a rank that stalls
            started = time.perf_counter()
            # Waiting for the batch ends the step before (from one plan to the next): a
            # step's `data` is the wait for the batch of the step after it.
            with balancer.timed(DATA):
                if cfg.slow_rank == rank:
                    balancer.wait_for_input()  # a slow loader (slow_kind input only)
                lengths, seed = batch(step)
                noisy, target = _flow_batch(lengths, mixing, torch.Generator().manual_seed(seed))
            plan = balancer.plan_routing(lengths, token_dim=d_model)
            if cfg.steps == 0 or step + 1 < cfg.steps:
                # The next batch is known now: with plan_ahead its plan is made while this
                # step trains (otherwise this does nothing).
                balancer.prefetch(batch(step + 1)[0], token_dim=d_model)
            group_elems = float(plan.sequences.length.sum()) * d_model

            with balancer.timed(FORWARD_BACKWARD):
                pred = model(noisy, lengths.tolist(), balancer)
                sq_err = (pred - target).square().sum()
                # Each rank's share of its group's mean loss, averaged over the replicas,
                # so that summing gradients over all ranks gives the gradient of the mean.
                (sq_err / (group_elems * balancer.num_replicas)).backward()
                if cfg.slow_rank == rank:
                    balancer.lag()  # the backward pass's slowdown, before the all-reduce

            stopping = float(stop is not None and stop())
            flat = torch.cat(
                [p.grad.reshape(-1) for p in params]
                + [sq_err.detach().reshape(1), torch.tensor([stopping])]
            )
            # Data parallel: one all-reduce of the gradients, the loss and the stop flag,
            # so every rank leaves the loop after the same step. Through the balancer, so
            # that the time waiting in it is measured as waiting, not compute.
            balancer.all_reduce(flat)
            offset = 0
            for p in params:
                n = p.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p))
                offset += n
            with balancer.timed(OPTIMIZER):
                optimizer.step()
                optimizer.zero_grad(set_to_none=False)
            done = time.perf_counter()

            if report is not None:
                # Host work of the reporting rank alone (the plan's stats, the message to
                # the launcher): timed as `host`, or it would read as this rank's compute.
                with balancer.timed(HOST):
                    stats = plan.stats
                    world_elems = group_elems * balancer.num_replicas
                    report(
                        StepReport(
                            step=plan.step,
                            loss=float(flat[-2]) / world_elems,
                            imbalance_before=float(stats.imbalance_before),
                            imbalance_after=float(stats.imbalance_after),
                            moved_tokens=int(stats.moved_tokens),
                            tokens=int(stats.total_tokens),
                            step_ms=(done - started) * 1e3,
                            times=dict(balancer.timings),
                        )
                    )
            step += 1
            if flat[-1] > 0:
                break
        balancer.finish()  # collective: the last plans get their measured times too
    finally:
        if profiler is not None:
            profiler.stop()  # writes this worker's trace
        balancer.close()


def _flow_batch(lengths, mixing, gen):
    """Flow-matching pairs for packed sequences: ``(noisy (T, d), target (T, d))``.

    Each sequence's tokens are noisy copies of one random latent (``mixing``: (k, d)), so
    denoising a token pays off from attending to the rest of its sequence.
    """
    import torch

    lens = torch.as_tensor(lengths, dtype=torch.int64)
    n = len(lens)
    latent = torch.randn(n, mixing.shape[0], generator=gen) @ mixing  # (n, d)
    clean = latent.repeat_interleave(lens, 0)
    clean = clean + 0.1 * torch.randn(clean.shape, generator=gen)
    noise = torch.randn(clean.shape, generator=gen)
    t = torch.rand(n, 1, generator=gen).repeat_interleave(lens, 0)
    return (1 - t) * clean + t * noise, noise - clean
