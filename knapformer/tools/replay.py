"""Replay a recorded routing plan on local CPU processes (gloo), one per GPU of the plan.

Two checks, both must pass:

1. *Planning*: every rank gives the recorded lengths to `SequenceBalancer.plan_routing`
   (the real all-gather + planner path); the plan it makes must equal the recorded one
   (same bags, sequences, workloads, chunks). Skipped, and said so, when the recorded
   plan cannot be re-planned: a legacy plan (solver / token_dim unknown) or a solver this
   version does not know.
2. *Routing*: the recorded plan's own routing is executed with synthetic tensors whose
   rows carry their global token id: ``route`` must deliver exactly the chunks the plan
   sends to each rank, ``pre_attn`` the bag's whole sequences with this rank's heads,
   ``post_attn`` the chunks back, and ``reverse_route`` every token to where it started.

The recorded plan is renumbered so that ``plan.gpus[i]`` runs as local rank i; messages
name the recorded GPU ranks.
"""

from __future__ import annotations

import os
import queue
import signal
import time
import traceback
from dataclasses import dataclass, field

import numpy as np

from knapformer import __version__
from knapformer.errors import KnapformerError
from knapformer.limits import MAX_REPLAY_GPUS, MAX_REPLAY_VALUES
from knapformer.local.local_world import join, rendezvous, worker_context
from knapformer.local.signals import deferring_sigint
from knapformer.plan import RoutingPlan, gpu_positions
from knapformer.planner import SOLVERS
from knapformer.topology import Topology

PHASES = ("plan", "route", "pre_attn", "post_attn", "reverse_route")
_FEATURE_BYTES = 8  # the int64 token id routed with every token


@dataclass
class RankReport:
    """What one rank saw; bytes count only what left / reached this rank's process."""

    rank: int  # local rank (position in plan.gpus)
    tokens_sent: int = 0  # route: tokens sent to other ranks
    tokens_received: int = 0  # route: tokens received from other ranks
    bytes_sent: int = 0  # route + Ulysses, to other ranks
    bytes_received: int = 0
    timings_ms: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # first routing difference on this rank (None: all good)
    plan_difference: str | None = None  # rank 0 only: first planning difference


@dataclass
class ReplayResult:
    plan: RoutingPlan  # the recorded plan, original GPU ranks
    replanned: bool  # False: planning check skipped (see ``skip_reason``)
    skip_reason: str | None
    plan_difference: str | None
    ranks: list[RankReport]
    dim: int
    heads: int

    @property
    def routing_errors(self) -> list[str]:
        return [r.error for r in self.ranks if r.error]

    @property
    def ok(self) -> bool:
        return self.plan_difference is None and not self.routing_errors

    @property
    def planner_changed(self) -> str | None:
        """ "recorded by planner X, this is Y" when the plans differ and the recording
        planner is not this one (then the difference is expected, not a bug)."""
        if self.plan_difference is None or self.plan.planner_version == __version__:
            return None
        recorded = self.plan.planner_version or "unknown (schema 1)"
        return f"recorded by planner {recorded}, this is {__version__}"

    @property
    def first_problem(self) -> str | None:
        if self.plan_difference:
            why = f" ({self.planner_changed})" if self.planner_changed else ""
            return f"planning differs{why}: {self.plan_difference}"
        errors = self.routing_errors
        return f"routing: {errors[0]}" if errors else None


# ------------------------------------------------------------------ comparison
def renumber(plan: RoutingPlan) -> RoutingPlan:
    """The same plan with ``plan.gpus[i]`` renamed to i (what local rank i executes)."""
    gpus = np.asarray(plan.gpus, dtype=np.int64)
    if np.array_equal(gpus, np.arange(len(gpus))):
        return plan
    lookup = gpu_positions(gpus)
    seqs, chunks = plan.sequences, plan.chunks
    return RoutingPlan.build(
        **{
            **{k: getattr(plan, k) for k in ("step", "time", "run", "topology", "token_dim")},
            "gamma": plan.gamma,
            "solver": plan.solver,
            "solver_options": dict(plan.solver_options),
            "gpus": list(range(len(gpus))),
            "bags": [[int(lookup[g]) for g in bag] for bag in plan.bags],
            "sequences": {
                "src_gpu": lookup[seqs.src_gpu],
                "length": seqs.length,
                "workload": seqs.workload,
                "bag": seqs.bag,
            },
            "chunks": {
                "seq": chunks.seq,
                "src_gpu": lookup[chunks.src_gpu],
                "dst_gpu": lookup[chunks.dst_gpu],
                "offset": chunks.offset,
                "length": chunks.length,
            },
            "measurements": None,
        }
    )


def first_difference(recorded: RoutingPlan, planned: RoutingPlan, gpus: list[int]) -> str | None:
    """The first way ``planned`` differs from ``recorded`` (both renumbered), or None.

    GPU values are named by their recorded ranks ``gpus[i]``.
    """
    for name in ("topology", "bags", "solver", "token_dim", "gamma"):
        a, b = getattr(recorded, name), getattr(planned, name)
        if a != b:
            return f"{name}: recorded {a!r}, planned {b!r}"
    gpu_columns = {"src_gpu", "dst_gpu"}
    for table in ("sequences", "chunks"):
        rec, new = getattr(recorded, table), getattr(planned, table)
        if len(rec) != len(new):
            return f"{table}: recorded {len(rec)} rows, planned {len(new)}"
        for column in type(rec).model_fields:
            a, b = np.asarray(getattr(rec, column)), np.asarray(getattr(new, column))
            bad = ~np.isclose(a, b, rtol=1e-09, atol=0.0) if column == "workload" else a != b
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                va, vb = a[i].item(), b[i].item()
                if column in gpu_columns:
                    va, vb = f"GPU {gpus[int(va)]}", f"GPU {gpus[int(vb)]}"
                what = "sequence" if table == "sequences" else "chunk"
                extra = f" ({int(bad.sum())} {what}s differ)" if bad.sum() > 1 else ""
                return f"{what} {i} {column}: recorded {va}, planned {vb}{extra}"
    return None


def replan_skip_reason(plan: RoutingPlan) -> str | None:
    """Why the recorded plan cannot be re-planned (None: it can)."""
    if plan.solver not in SOLVERS:
        return f"solver {plan.solver!r} is not one this version plans with"
    if plan.token_dim is None or plan.gamma is None:
        return "the plan records no token_dim/gamma (a legacy plan)"
    return None


# ------------------------------------------------------------------ running
def default_heads(plan: RoutingPlan) -> int:
    """Smallest multiple of every bag size that is >= 4 (heads must split evenly)."""
    return Topology.from_bag_sizes([len(b) for b in plan.bags]).heads_for(4)


def check_options(
    plan: RoutingPlan, dim: int | None = None, heads: int | None = None
) -> tuple[int, int]:
    """The (dim, heads) a replay of ``plan`` uses (defaults filled in), or a ValueError
    naming the bad value. Cheap: callers validate with it before announcing a replay."""
    n = len(plan.gpus)
    if n > MAX_REPLAY_GPUS:
        raise ValueError(
            f"the plan has {n} GPUs; replay runs one local process per GPU and stops at "
            f"{MAX_REPLAY_GPUS}"
        )
    heads = default_heads(plan) if heads is None else int(heads)
    bad = sorted({len(b) for b in plan.bags if heads % len(b)})
    if heads <= 0 or bad:
        raise ValueError(
            f"--heads {heads} must be a positive multiple of every bag size "
            f"(not divisible by {bad}); try {default_heads(plan)}"
        )
    dim = heads * 8 if dim is None else int(dim)
    if dim <= 0 or dim % heads:
        raise ValueError(f"--dim {dim} must be a positive multiple of --heads {heads}")
    values = int(plan.sequences.length.sum()) * dim
    if values > MAX_REPLAY_VALUES:
        raise KnapformerError(
            f"a replay of this plan holds {values:,} token values ({plan.sequences.length.sum():,} "
            f"tokens × --dim {dim}); at most {MAX_REPLAY_VALUES:,} (knapformer.limits): replay "
            "is for plans of test-sized runs, or give a smaller --dim"
        )
    return dim, heads


def replay(
    plan: RoutingPlan,
    dim: int | None = None,
    heads: int | None = None,
    timeout_s: float = 300.0,
    start_method: str = "forkserver",
) -> ReplayResult:
    """Run both checks on ``len(plan.gpus)`` local processes. ``dim`` = hidden size of
    the synthetic tensors (a multiple of ``heads``; default 8 per head).

    ``start_method``: workers fork from a server that imported torch once
    (``"forkserver"``, safe whatever this process has run), or from this process
    (``"fork"``: they inherit its state, including patches — for tests).
    """
    dim, heads = check_options(plan, dim, heads)
    skip = replan_skip_reason(plan)
    local = renumber(plan)
    reports = _run_workers(
        local, list(plan.gpus), dim, heads, skip is None, timeout_s, start_method
    )
    difference = next((r.plan_difference for r in reports if r.plan_difference), None)
    return ReplayResult(plan, skip is None, skip, difference, reports, dim, heads)


def _run_workers(
    plan: RoutingPlan,
    gpus: list[int],
    dim: int,
    heads: int,
    replan: bool,
    timeout_s: float,
    start_method: str = "forkserver",
) -> list[RankReport]:
    with rendezvous("knapformer-replay-") as init_method:
        return _supervise(plan, gpus, dim, heads, replan, timeout_s, start_method, init_method)


def _supervise(plan, gpus, dim, heads, replan, timeout_s, start_method, init_method):
    n = len(gpus)
    ctx = worker_context(start_method=start_method)
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, n, init_method, plan, gpus, dim, heads, replan, results),
            daemon=True,
        )
        for rank in range(n)
    ]
    reports: dict[int, RankReport] = {}
    deadline = time.monotonic() + timeout_s
    try:
        with deferring_sigint():
            for p in procs:
                p.start()
        while len(reports) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"replay timed out after {timeout_s:.0f} s")
            try:
                report = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    rank = procs.index(dead[0])
                    raise RuntimeError(
                        f"replay process of GPU {gpus[rank]} died (exit code {dead[0].exitcode})"
                    ) from None
                continue
            reports[report.rank] = report
            if report.error and report.error.startswith("crashed:"):
                break  # the others would wait for it in a collective
    finally:
        started = [p for p in procs if p.pid is not None]
        # One deadline for all: after a crash or Ctrl-C the rest are killed, not awaited.
        until = time.monotonic() + (5.0 if len(reports) == n else 0.5)
        for p in started:
            p.join(timeout=max(0.0, until - time.monotonic()))
        for p in started:
            if p.is_alive():
                p.kill()
                p.join()
    crashed = [r for r in reports.values() if r.error and r.error.startswith("crashed:")]
    if crashed:
        raise RuntimeError(f"replay process of GPU {gpus[crashed[0].rank]} {crashed[0].error}")
    return [reports[r] for r in range(n)]


def _worker(rank, world, init_method, plan, gpus, dim, heads, replan, results) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    report = RankReport(rank)
    try:
        import torch.distributed as dist

        join(rank, world, init_method)
        try:
            _replay_rank(report, plan, gpus, dim, heads, replan)
        finally:
            dist.destroy_process_group()
    except Exception as err:  # reported to the parent, which names the rank
        last = traceback.extract_tb(err.__traceback__)[-1]
        report.error = f"crashed: {type(err).__name__}: {err} ({last.filename}:{last.lineno})"
    results.put(report)


def _replay_rank(report: RankReport, plan: RoutingPlan, gpus, dim, heads, replan) -> None:
    import torch

    from knapformer.balancer import SequenceBalancer
    from knapformer.router import token_ranges

    rank = report.rank
    seqs, chunks = plan.sequences, plan.chunks
    solver = plan.solver if replan else "knapformer"
    gamma = plan.gamma if replan else 0.4
    cap = plan.solver_options.get("max_tokens_per_gpu") if replan else None
    balancer = SequenceBalancer(plan.topology, gamma=gamma, solver=solver, max_tokens_per_gpu=cap)

    mine = np.flatnonzero(seqs.src_gpu == rank)
    local_lens = seqs.length[mine]
    if replan:
        fresh = balancer.plan_routing(local_lens, token_dim=plan.token_dim)
        if rank == 0:
            report.plan_difference = first_difference(plan, fresh, gpus)
    else:
        # Nothing to re-plan with: still time the all-gather of lengths, as training does.
        balancer.plan_routing(local_lens, token_dim=plan.token_dim or dim)
    balancer.use_plan(plan)  # execute the *recorded* routing, whatever the planner made

    # Global token ids: sequence s owns ids seq_start[s] .. seq_start[s] + length - 1.
    seq_start = np.concatenate([[0], np.cumsum(seqs.length)[:-1]]).astype(np.int64)
    ids = token_ranges(seq_start[mine], local_lens)
    token_id = torch.from_numpy(ids)
    x = _payload(token_id, dim)
    for_me = np.flatnonzero(chunks.dst_gpu == rank)  # chunk-id order
    expected = token_ranges(
        seq_start[chunks.seq[for_me]] + chunks.offset[for_me], chunks.length[for_me]
    )

    def fail(message: str) -> None:
        if report.error is None:
            report.error = f"GPU {gpus[rank]}: {message}"

    chunk_lens, routed, feats = balancer.route(x, {"token_id": token_id})
    got = feats["token_id"].numpy()
    if list(chunk_lens) != chunks.length[for_me].tolist():
        fail(f"route gave chunk lengths {chunk_lens[:8]}, plan says {chunks.length[for_me][:8]}")
    elif not np.array_equal(got, expected):
        i = int(np.flatnonzero(got != expected)[0])
        fail(f"route: row {i} holds token {got[i]}, plan expects token {expected[i]}")
    elif not torch.equal(routed, _payload(feats["token_id"], dim)):
        fail("route: token values arrived changed")
    stats = plan.stats  # renumbered: GPU position = local rank
    moved, arrived = stats.tokens_sent[rank], stats.tokens_received[rank]
    per_token = dim * x.element_size() + _FEATURE_BYTES
    report.tokens_sent, report.tokens_received = int(moved), int(arrived)
    report.bytes_sent, report.bytes_received = int(moved) * per_token, int(arrived) * per_token

    # q/k/v: (T_chunks, H, D) float64 holding token_id*H + head exactly (< 2^53).
    head_dim = dim // heads
    tid = feats["token_id"].to(torch.float64)
    head = torch.arange(heads, dtype=torch.float64)
    base = (tid[:, None] * heads + head[None, :])[:, :, None].expand(-1, -1, head_dim)
    q, k, v = base.contiguous(), (base + 0.25).contiguous(), (base + 0.5).contiguous()
    seq_lens, q2, k2, v2 = balancer.pre_attn(q, k, v)
    bag = next(b for b in plan.bags if rank in b)
    g = len(bag)
    bag_id = plan.bags.index(bag)
    bag_seqs = np.flatnonzero((seqs.bag == bag_id) & (seqs.length > 0))
    if g > 1:
        want_ids = token_ranges(seq_start[bag_seqs], seqs.length[bag_seqs])
        share = heads // g
        r = bag.index(rank)
        want_heads = torch.arange(r * share, (r + 1) * share, dtype=torch.float64)
        want = torch.from_numpy(want_ids).to(torch.float64)[:, None] * heads + want_heads[None, :]
        got_q = q2[:, :, 0]
        if list(seq_lens) != seqs.length[bag_seqs].tolist():
            fail(
                f"pre_attn gave sequence lengths {list(seq_lens)[:8]}, bag {bag_id} has "
                f"{seqs.length[bag_seqs][:8].tolist()}"
            )
        elif got_q.shape != want.shape or not torch.equal(got_q, want):
            fail(f"pre_attn: bag {bag_id} sequences or heads arrived out of place")
        elif not (torch.equal(k2, q2 + 0.25) and torch.equal(v2, q2 + 0.5)):
            fail("pre_attn: k or v do not line up with q")
        # Ulysses: pre_attn sends q, k, v of (g-1)/g of this rank's chunk rows with the
        # other ranks' heads and receives its heads of the others' rows; post_attn (the
        # output only) reverses it.
        row = q.element_size() * heads * head_dim  # all heads of one token
        others = sum(balancer.tables.bag.tokens_per_gpu) - q.shape[0]
        out_rows = q.shape[0] * (g - 1) // g
        report.bytes_sent += 3 * out_rows * row + others * row // g
        report.bytes_received += 3 * others * row // g + out_rows * row
    # "Attention" = v itself, so post_attn must give back the chunks' v exactly.
    _chunk_lens2, out = balancer.post_attn(v2)
    if report.error is None and not torch.equal(out, v):
        fail("post_attn: the attention output did not come back to its chunk rows")

    seq_lens_back, back, back_feats = balancer.reverse_route(
        routed, {"token_id": feats["token_id"]}
    )
    back_ids = back_feats["token_id"].numpy()
    if list(seq_lens_back) != local_lens.tolist():
        fail(f"reverse_route gave lengths {list(seq_lens_back)[:8]}, expected {local_lens[:8]}")
    elif not np.array_equal(back_ids, ids):
        i = int(np.flatnonzero(back_ids != ids)[0])
        fail(f"reverse_route: row {i} got token {back_ids[i]}, it started with token {ids[i]}")
    elif not torch.equal(back, x):
        fail("reverse_route: token values came back changed")
    report.bytes_sent += int(moved) * per_token  # reverse_route sends what it received
    report.bytes_received += int(arrived) * per_token
    report.timings_ms = {p: float(t) for p, t in balancer.timings.items()}


def _payload(token_id, dim: int):
    """(T, dim) float32 rows that depend on the token id (exact for ids < 2^24)."""
    import torch

    col = torch.arange(dim, dtype=torch.float32)
    return (token_id.to(torch.float32) % 4096)[:, None] + col[None, :] / dim
