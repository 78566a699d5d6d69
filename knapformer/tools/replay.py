"""Replay a recorded routing plan on local CPU processes (gloo), one per GPU of the plan.

Two checks, both must pass:

1. *Planning*: every rank gives the recorded lengths to `SequenceBalancer.plan_routing`
   (the real all-gather + planner path) with the recorded model: gamma, the time scale
   of a calibrated plan, and the GPU speeds it assumed (``gpu_speed``, e.g. learnt by the
   history cost model); the plan it makes must equal the recorded one (same bags,
   sequences, workloads, chunks). Skipped, and said so, when the recorded plan cannot be
   re-planned: a legacy plan (solver / token_dim unknown) or a solver this version does
   not know.
2. *Routing*: the recorded plan's own routing is executed with synthetic tensors whose
   rows carry their global token id: ``route`` must deliver exactly the chunks the plan
   sends to each rank, ``pre_attn`` the bag's whole sequences with this rank's heads,
   ``post_attn`` the chunks back, and ``reverse_route`` every token to where it started.

The recorded plan is renumbered so that ``plan.gpus[i]`` runs as local rank i; messages
name the recorded GPU ranks.

A plan whose bags the planner chose (``policy="auto"``) is replayed by a balancer with
``topology="auto"`` and the plan's own options (its ``solver_options``: the group sizes and
the communication model, node size included), which creates the sub-group of every
aligned group those sizes allow; the routing check then runs in the plan's own bags
(``plan.bags``, in rank order), as training did.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from knapformer import __version__
from knapformer.contract.limits import MAX_REPLAY_GPUS, MAX_REPLAY_VALUES
from knapformer.contract.plan import RoutingPlan, layout_problem
from knapformer.contract.positions import gpu_positions
from knapformer.contract.topology import heads_for
from knapformer.errors import KnapformerError, OptionError
from knapformer.local.launcher import WorkerFailed, launch
from knapformer.planning.communication import CommModel
from knapformer.planning.planner import AUTO, SOLVERS

_FEATURE_BYTES = 8  # the int64 token id routed with every token
_GRACE_S = 1.0  # replay workers do not watch the stop flag: stop them soon after Ctrl-C


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
            **{k: getattr(plan, k) for k in ("gamma", "scale", "workload_unit", "gpu_speed")},
            "solver": plan.solver,
            "policy": plan.policy,
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
    names = ("policy", "topology", "bags", "solver", "token_dim", "gamma", "workload_unit",
             "gpu_speed")  # fmt: skip
    for name in names:
        a, b = getattr(recorded, name), getattr(planned, name)
        if a != b:
            return f"{name}: recorded {a!r}, planned {b!r}"
    a, b = recorded.scale or 1.0, planned.scale or 1.0  # None: an unscaled model
    if a != b:
        return f"scale: recorded {a!r}, planned {b!r}"
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
    if plan.workload_unit != "ms" and (plan.scale or 1.0) != 1.0:
        return f"the plan's workload scale {plan.scale} is not a time scale (unit model)"
    return None


# ------------------------------------------------------------------ running
def auto_options(plan: RoutingPlan) -> dict[str, Any]:
    """The `SequenceBalancer` options that re-plan an auto plan (``policy="auto"``) as it
    was planned: its group sizes and communication model (``solver_options``). A plan
    without them (written by hand) gets the sizes of its own bags, whichever node they
    span, which is enough to execute its routing."""
    saved = plan.solver_options
    sizes = saved.get("group_sizes") or sorted({len(b) for b in plan.bags})
    comm = CommModel.from_options(saved)
    return {
        "comm": comm,
        "group_sizes": tuple(sizes),
        # Sizes above the node were allowed when the plan was made (the planner drops them
        # otherwise): allow them again.
        "cross_node": any(g > comm.node_size for g in sizes) or "comm" not in saved,
    }


def bag_sizes(plan: RoutingPlan) -> list[int]:
    """Every bag size the replaying balancer may use: the plan's, and under ``auto`` every
    allowed group size (the balancer checks heads against all of them)."""
    sizes = {len(b) for b in plan.bags}
    if plan.policy == AUTO:
        sizes |= set(auto_options(plan)["group_sizes"])
    return sorted(sizes)


def default_heads(plan: RoutingPlan) -> int:
    """Smallest multiple of every bag size that is >= 4 (heads must split evenly)."""
    return heads_for(bag_sizes(plan), 4)


def check_options(
    plan: RoutingPlan, dim: int | None = None, heads: int | None = None
) -> tuple[int, int]:
    """The (dim, heads) a replay of ``plan`` uses (defaults filled in), or a
    `KnapformerError` naming the bad value. Cheap: callers validate with it before
    announcing a replay."""
    n = len(plan.gpus)
    if n > MAX_REPLAY_GPUS:
        raise KnapformerError(
            f"the plan has {n} GPUs; replay runs one local process per GPU and stops at "
            f"{MAX_REPLAY_GPUS}"
        )
    problem = layout_problem(plan)  # a plan built in Python, not read from a file
    if problem is not None:
        raise KnapformerError(f"this plan cannot be replayed: {problem}")
    heads = default_heads(plan) if heads is None else int(heads)
    bad = [g for g in bag_sizes(plan) if heads % g]
    if heads <= 0 or bad:
        raise OptionError(
            f"`heads` {heads} must be a positive multiple of every bag size "
            f"(not divisible by {bad}); try {default_heads(plan)}"
        )
    dim = heads * 8 if dim is None else int(dim)
    if dim <= 0 or dim % heads:
        raise OptionError(f"`dim` {dim} must be a positive multiple of `heads` {heads}")
    values = int(plan.sequences.length.sum()) * dim
    if values > MAX_REPLAY_VALUES:
        raise KnapformerError(
            f"a replay of this plan holds {values:,} token values ({plan.sequences.length.sum():,} "
            f"tokens × dim {dim}); at most {MAX_REPLAY_VALUES:,} (knapformer.contract.limits): "
            "replay is for plans of test-sized runs, or give a smaller dim"
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
    (``"fork"``: they inherit its state, including patches — for tests). Raises
    ``RuntimeError`` naming the GPU whose process died, raised or hung.
    """
    dim, heads = check_options(plan, dim, heads)
    skip = replan_skip_reason(plan)
    gpus = list(plan.gpus)
    try:
        reports = launch(
            _worker,
            len(gpus),
            (renumber(plan), gpus, dim, heads, skip is None),
            deadline_s=timeout_s,
            grace_s=_GRACE_S,
            start_method=start_method,
        )
    except WorkerFailed as err:
        who = "replay processes" if err.rank is None else f"replay process of GPU {gpus[err.rank]}"
        raise RuntimeError(f"{who} {err.what}") from err
    difference = next((r.plan_difference for r in reports if r.plan_difference), None)
    return ReplayResult(plan, skip is None, skip, difference, reports, dim, heads)


def _worker(rank, world, plan, gpus, dim, heads, replan) -> RankReport:
    """Both checks on one local rank (launched by `replay`)."""
    report = RankReport(rank)
    balancer = _replan(report, plan, gpus, dim, replan)
    check = _RankCheck(report, plan, gpus, dim, heads, balancer)
    x, routed, routed_ids = _check_route(check)
    v, v2 = _check_pre_attn(check, routed_ids)
    _check_post_attn(check, v, v2)
    _check_reverse_route(check, x, routed, routed_ids)
    report.timings_ms = {p: float(t) for p, t in balancer.timings.items()}
    return report


@dataclass
class _RankCheck:
    """What the routing checks of one rank share; the first difference goes to ``report``."""

    report: RankReport
    plan: RoutingPlan  # renumbered: GPU i is local rank i
    gpus: list[int]  # recorded GPU ranks, for messages
    dim: int
    heads: int
    balancer: Any  # a SequenceBalancer executing ``plan``

    @property
    def rank(self) -> int:
        return self.report.rank

    @cached_property
    def seq_start(self) -> np.ndarray:
        """Global id of each sequence's first token: sequence s owns ids seq_start[s] ..
        seq_start[s] + length - 1."""
        lengths = self.plan.sequences.length
        return np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)

    @cached_property
    def mine(self) -> np.ndarray:
        """Ids of the sequences that start on this rank."""
        return np.flatnonzero(self.plan.sequences.src_gpu == self.rank)

    @cached_property
    def own_ids(self) -> np.ndarray:
        """(T,) global ids of the tokens this rank starts with, in order."""
        from knapformer.runtime.router import token_ranges

        return token_ranges(self.seq_start[self.mine], self.plan.sequences.length[self.mine])

    def fail(self, message: str) -> None:
        if self.report.error is None:
            self.report.error = f"GPU {self.gpus[self.rank]}: {message}"


def _replan(report: RankReport, plan: RoutingPlan, gpus, dim: int, replan: bool):
    """A balancer that re-planned from this rank's recorded lengths (rank 0 compares the
    result with the recording) and then executes the *recorded* routing."""
    from knapformer.runtime.balancer import SequenceBalancer

    model: dict[str, Any] = {}
    if replan:  # the model the recording planned with
        model = {
            "gamma": plan.gamma,
            "solver": plan.solver,
            "max_tokens_per_gpu": plan.solver_options.get("max_tokens_per_gpu"),
            "gpu_speed": plan.gpu_speed,
            "time_scale": plan.scale if plan.workload_unit == "ms" else None,
        }
    if plan.policy == AUTO:
        balancer = SequenceBalancer(AUTO, **model, **auto_options(plan))
    else:
        balancer = SequenceBalancer(plan.topology, **model)
    local_lens = plan.sequences.length[plan.sequences.src_gpu == report.rank]
    if replan:
        fresh = balancer.plan_routing(local_lens, token_dim=plan.token_dim)
        if report.rank == 0:
            report.plan_difference = first_difference(plan, fresh, gpus)
    else:
        # Nothing to re-plan with: still time the all-gather of lengths, as training does.
        balancer.plan_routing(local_lens, token_dim=plan.token_dim or dim)
    balancer.use_plan(plan)
    return balancer


def _check_route(c: _RankCheck):
    """``route`` delivers exactly the chunks the plan sends to this rank, values intact.
    Returns (this rank's tokens (T, dim), routed chunks (T', dim), their token ids (T',))."""
    import torch

    from knapformer.runtime.router import token_ranges

    chunks, rank = c.plan.chunks, c.rank
    token_id = torch.from_numpy(c.own_ids)
    x = _payload(token_id, c.dim)
    for_me = np.flatnonzero(chunks.dst_gpu == rank)  # chunk-id order
    expected = token_ranges(
        c.seq_start[chunks.seq[for_me]] + chunks.offset[for_me], chunks.length[for_me]
    )
    chunk_lens, routed, feats = c.balancer.route(x, {"token_id": token_id})
    got = feats["token_id"].numpy()
    if list(chunk_lens) != chunks.length[for_me].tolist():
        c.fail(f"route gave chunk lengths {chunk_lens[:8]}, plan says {chunks.length[for_me][:8]}")
    elif not np.array_equal(got, expected):
        i = int(np.flatnonzero(got != expected)[0])
        c.fail(f"route: row {i} holds token {got[i]}, plan expects token {expected[i]}")
    elif not torch.equal(routed, _payload(feats["token_id"], c.dim)):
        c.fail("route: token values arrived changed")
    stats = c.plan.stats  # renumbered: GPU position = local rank
    c.report.tokens_sent = int(stats.tokens_sent[rank])
    c.report.tokens_received = int(stats.tokens_received[rank])
    per_token = c.dim * x.element_size() + _FEATURE_BYTES
    c.report.bytes_sent += c.report.tokens_sent * per_token
    c.report.bytes_received += c.report.tokens_received * per_token
    return x, routed, feats["token_id"]


def _check_pre_attn(c: _RankCheck, routed_ids):
    """``pre_attn`` gives a multi-GPU bag's ranks the bag's whole sequences with their
    share of the heads. q/k/v: (T', H, D) float64 holding token_id*H + head exactly
    (< 2^53), k and v offset by 0.25 and 0.5. Returns (v, v after pre_attn)."""
    import torch

    from knapformer.runtime.router import token_ranges

    seqs, rank, heads = c.plan.sequences, c.rank, c.heads
    head_dim = c.dim // heads
    tid = routed_ids.to(torch.float64)
    head = torch.arange(heads, dtype=torch.float64)
    base = (tid[:, None] * heads + head[None, :])[:, :, None].expand(-1, -1, head_dim)
    q, k, v = base.contiguous(), (base + 0.25).contiguous(), (base + 0.5).contiguous()
    seq_lens, q2, k2, v2 = c.balancer.pre_attn(q, k, v)
    bag_id, bag = next((i, b) for i, b in enumerate(c.plan.bags) if rank in b)
    g = len(bag)
    if g == 1:
        return v, v2
    bag_seqs = np.flatnonzero((seqs.bag == bag_id) & (seqs.length > 0))
    want_ids = token_ranges(c.seq_start[bag_seqs], seqs.length[bag_seqs])
    share = heads // g
    r = bag.index(rank)
    want_heads = torch.arange(r * share, (r + 1) * share, dtype=torch.float64)
    want = torch.from_numpy(want_ids).to(torch.float64)[:, None] * heads + want_heads[None, :]
    got_q = q2[:, :, 0]
    if list(seq_lens) != seqs.length[bag_seqs].tolist():
        c.fail(
            f"pre_attn gave sequence lengths {list(seq_lens)[:8]}, bag {bag_id} has "
            f"{seqs.length[bag_seqs][:8].tolist()}"
        )
    elif got_q.shape != want.shape or not torch.equal(got_q, want):
        c.fail(f"pre_attn: bag {bag_id} sequences or heads arrived out of place")
    elif not (torch.equal(k2, q2 + 0.25) and torch.equal(v2, q2 + 0.5)):
        c.fail("pre_attn: k or v do not line up with q")
    # Ulysses: pre_attn sends q, k, v of (g-1)/g of this rank's chunk rows with the other
    # ranks' heads and receives its heads of the others' rows; post_attn (the output
    # only) reverses it.
    row = q.element_size() * heads * head_dim  # all heads of one token
    others = sum(c.balancer.tables.bag.tokens_per_gpu) - q.shape[0]
    out_rows = q.shape[0] * (g - 1) // g
    c.report.bytes_sent += 3 * out_rows * row + others * row // g
    c.report.bytes_received += 3 * others * row // g + out_rows * row
    return v, v2


def _check_post_attn(c: _RankCheck, v, v2) -> None:
    """Attention here is v itself, so ``post_attn`` must give back the chunks' v exactly."""
    import torch

    _chunk_lens, out = c.balancer.post_attn(v2)
    if c.report.error is None and not torch.equal(out, v):
        c.fail("post_attn: the attention output did not come back to its chunk rows")


def _check_reverse_route(c: _RankCheck, x, routed, routed_ids) -> None:
    """``reverse_route`` brings every token back to where it started, values intact."""
    import torch

    local_lens = c.plan.sequences.length[c.mine]
    ids = c.own_ids
    seq_lens_back, back, back_feats = c.balancer.reverse_route(routed, {"token_id": routed_ids})
    back_ids = back_feats["token_id"].numpy()
    if list(seq_lens_back) != local_lens.tolist():
        c.fail(f"reverse_route gave lengths {list(seq_lens_back)[:8]}, expected {local_lens[:8]}")
    elif not np.array_equal(back_ids, ids):
        i = int(np.flatnonzero(back_ids != ids)[0])
        c.fail(f"reverse_route: row {i} got token {back_ids[i]}, it started with token {ids[i]}")
    elif not torch.equal(back, x):
        c.fail("reverse_route: token values came back changed")
    # It sends back the chunks that arrived here and receives this rank's own.
    per_token = c.dim * x.element_size() + _FEATURE_BYTES
    c.report.bytes_sent += c.report.tokens_received * per_token
    c.report.bytes_received += c.report.tokens_sent * per_token


def _payload(token_id, dim: int):
    """(T, dim) float32 rows that depend on the token id (exact for ids < 2^24)."""
    import torch

    col = torch.arange(dim, dtype=torch.float32)
    return (token_id.to(torch.float32) % 4096)[:, None] + col[None, :] / dim
