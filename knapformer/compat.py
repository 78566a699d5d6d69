"""The original research code's `SequenceBalancer` interface, on top of ours.

Code written for the KnapFormer research code switches by changing one import line::

    from knapformer.compat import SequenceBalancer  # was: from knapformer import SequenceBalancer

    balancer = SequenceBalancer("g1n2+g2n1+g4n1")          # gamma 1.0, the greedy solver
    balancer.plan_routing(seq_lens, token_dim)              # seq_lens: list or tensor
    balancer.print_imbalance()                              # logged at INFO, as before
    chunk_lens, x, feats = balancer.route(x, [rope, other])
    seq_lens, q, k, v = balancer.pre_attn(q, k, v)          # seq_lens: int32 tensor
    chunk_lens, out = balancer.post_attn(out)               # chunk_lens: int32 tensor
    seq_lens, y, _ = balancer.reverse_route(x)              # the seq_lens given above
    summary = balancer.get_routing_plan_summary()           # the int-keyed legacy dict
    balancer.turn_on_tracking(num_layers, include_bwd)      # then, after the steps:
    balancer.print_tracking_results()                       # the simulator's imbalance lines

What it keeps from the original: the constructor ``(bag_specs, gamma=1.0)`` and its
solver (greedy, the published algorithm; ours defaults to γ 0.4 and our own solver), the
length types each call returns (a tuple of ints from `route`, int32 tensors on the data's
device from `pre_attn` / `post_attn`, the caller's own lengths from `reverse_route`),
`print_imbalance`, `nice_print`, `get_routing_plan_summary` and the summary's fields as
attributes (``balancer.gpu_id2seq_lens[balancer.this_gpu_id]``, as MMDiT integrations
read them), the rest of the plan's views the research code kept as attributes
(``gpu_id2total_workload``, ``orig_minmax_workload``, ``bag_id2occupancy``, ...), its
tracking API (``turn_on_tracking`` ... ``print_tracking_results``, ``tracked_tflops``)
and ``metrics``. Everything runs on `knapformer.runtime.balancer.SequenceBalancer` (``.balancer``),
so gloo works as well as NCCL, ``last_plan`` is a `RoutingPlan`, and keyword-only
options (``solver``, ``recorder``, ``run``, ...) reach the rest of the toolkit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from knapformer.contract.legacy import LEGACY_KEYS, plan_to_legacy
from knapformer.contract.plan import RoutingPlan
from knapformer.contract.topology import Topology, as_topology
from knapformer.errors import KnapformerError
from knapformer.planning.workload import WorkloadModel
from knapformer.runtime.balancer import SequenceBalancer as _Balancer
from knapformer.runtime.router import Features, Group

logger = logging.getLogger(__name__)

# The research code's defaults: attention weighed fully, sequences placed greedily.
ORIGINAL_GAMMA = 1.0
ORIGINAL_SOLVER = "greedy"

# The research code's attributes that describe the current plan besides the summary's
# fields (LEGACY_KEYS); `_plan_views` makes them.
PLAN_VIEWS = (
    "local_seq_lens",
    "seq_id2gpu_id",
    "gpu_id2total_workload",
    "per_gpu_capacity",
    "seq_id2assigned_bag_id",
    "bag_id2capacity",
    "bag_id2assigned_seq_ids",
    "bag_id2occupancy",
    "chunk_id2gpu_id",
    "chunk_id2chunk_len",
    "balance_gpu_id2chunk_ids",
    "balance_gpu_id2chunk_lens",
    "balance_gpu_id2seq_ids",
    "balance_gpu_id2total_workload",
    "orig_minmax_workload",
    "bala_minmax_workload",
)
# What tracking keeps per planned step, in `print_tracking_results`' order.
TRACKED = (
    ("tracked_per_gpu_capacity", "Per GPU Capacity"),
    ("tracked_original_imbalance_ratio", "Original Imbalance Ratio"),
    ("tracked_balanced_imbalance_ratio", "Balanced Imbalance Ratio"),
)


def workload_estimator(seq_len: int, d: int, gamma: float = ORIGINAL_GAMMA) -> float:
    """Workload of one sequence of ``seq_len`` tokens and token dimension ``d`` (the
    research code's function, γ 1.0 by default); `WorkloadModel.workload` computes it."""
    return float(WorkloadModel(int(d), gamma).workload(seq_len))


def tflops_estimator(seq_len: int, d: int, num_layers: int, include_bwd: bool = False) -> float:
    """TFLOPs of one sequence through ``num_layers`` blocks (the research code's function):
    the γ 1.0 workload per layer; with ``include_bwd`` backward (twice the forward) and one
    recomputed forward (activation checkpointing) on top, 4x in all."""
    return _tflops([seq_len], d, num_layers, include_bwd)


def _tflops(lengths: Any, d: int, num_layers: int, include_bwd: bool) -> float:
    """`tflops_estimator` summed over ``lengths``."""
    per_layer = WorkloadModel(int(d), ORIGINAL_GAMMA).workload(np.asarray(lengths)).sum()
    return float(per_layer) * num_layers * (4 if include_bwd else 1)


class SequenceBalancer:
    """The research code's balancer interface, backed by `knapformer.runtime.balancer`.

    Args:
        bag_specs: compute bags, e.g. ``"g1n2+g2n1+g4n1"``, or ``"auto"`` (the planner chooses
            each step's bags; the bag views then follow the latest plan).
        gamma: attention weight of the workload model (the research code's 1.0).
        solver: ``"greedy"`` (the research code's algorithm) or ``"knapformer"``.
        process_group, max_tokens_per_gpu, recorder, run: as for
            `knapformer.runtime.balancer.SequenceBalancer` (the research code had none of them).
    """

    def __init__(
        self,
        bag_specs: str,
        gamma: float = ORIGINAL_GAMMA,
        *,
        solver: str = ORIGINAL_SOLVER,
        process_group: Group = None,
        max_tokens_per_gpu: int | None = None,
        recorder: Any = None,
        run: str | None = None,
    ) -> None:
        self.bag_specs = bag_specs
        self.balancer = _Balancer(
            bag_specs,
            gamma=gamma,
            solver=solver,
            process_group=process_group,
            max_tokens_per_gpu=max_tokens_per_gpu,
            recorder=recorder,
            run=run,
        )
        self._given_seq_lens: Any = None  # what the caller passed to plan_routing
        # Views of one plan, rebuilt when the plan changes: the legacy summary and the
        # length tensors (per kind and device; built once, read by every layer).
        self._views_of: RoutingPlan | None = None
        self._summary: dict[str, Any] | None = None
        self._views: dict[str, Any] | None = None
        self._lengths: dict[tuple[str, torch.device], torch.Tensor] = {}
        # Tracking (the research code's names): off until turn_on_tracking.
        self.tracking = False
        self.num_layers, self.include_bwd = 1, False
        self.tracked_tflops: list[float] = []
        for name, _ in TRACKED:
            setattr(self, name, [])
        # The research code's run-time figures of the latest step, set by plan_routing
        # and reverse_route; our per-phase timings (ms) are added as ``<phase>_ms``.
        self.metrics: dict[str, float] = {
            "start_time": 0.0,
            "end_time": 0.0,
            "total_tokens": 0,
            "duration_sec": 0.0,
            "avg_per_gpu_tokens": 0.0,
        }

    # ------------------------------------------------------------ attributes
    @property
    def gamma(self) -> float:
        return self.balancer.gamma

    @property
    def solver(self) -> str:
        return self.balancer.solver

    @property
    def topology(self) -> Topology:
        """The compute bags: the constructor's, or under ``"auto"`` the latest plan's (the
        planner chooses each step's; a `KnapformerError` before the first plan)."""
        if self.balancer.auto is None:
            return self.balancer.topology
        return as_topology(self._require_auto_plan().topology)

    def _require_auto_plan(self) -> RoutingPlan:
        plan = self.balancer.last_plan
        if plan is None:
            raise KnapformerError(
                "topology 'auto' chooses each step's bags: they are known once "
                "plan_routing(...) has been called"
            )
        return plan

    def _bags(self) -> list[list[int]]:
        """GPU ids of each bag, by bag id (under ``"auto"``: the latest plan's bags, in
        their plan order)."""
        if self.balancer.auto is None:
            return self.topology.bags(self.balance_gpu_ids)
        return [list(b) for b in self._require_auto_plan().bags]

    @property
    def this_gpu_id(self) -> int:
        return self.balancer.rank

    @property
    def balance_gpu_ids(self) -> list[int]:
        return list(self.balancer.group_ranks)

    @property
    def balance_process_group(self) -> dist.ProcessGroup:
        """The balance group (WORLD when the world holds a single replica)."""
        return self.balancer.group if self.balancer.group is not None else dist.group.WORLD

    @property
    def last_plan(self) -> RoutingPlan | None:
        return self.balancer.last_plan

    @property
    def this_device(self) -> torch.device:
        """Where the balancer's collectives run (the CPU on gloo, the GPU on NCCL)."""
        return self.balancer.device

    @property
    def parsed_bag_specs(self) -> list[tuple[int, int]]:
        """``(GPUs per bag, number of such bags)``, smallest bags first."""
        sizes = [len(b) for b in self._bags()]
        return [(g, sizes.count(g)) for g in sorted(set(sizes))]

    @property
    def bag_gpu_options(self) -> list[int]:
        """The bag sizes, ascending."""
        return [g for g, _ in self.parsed_bag_specs]

    @property
    def bag_gpu_options2bag_ids(self) -> dict[int, list[int]]:
        """Bag size -> ids of the bags of that size."""
        out: dict[int, list[int]] = {g: [] for g in self.bag_gpu_options}
        for bag_id, gpus in enumerate(self._bags()):
            out[len(gpus)].append(bag_id)
        return out

    @property
    def bag_id2process_group(self) -> dict[int, Any]:
        """Bag id -> its process group, for this rank's own bag of several GPUs; None for a
        bag of one GPU and for the bags this rank is not in (no collective of theirs runs
        here)."""
        bags = self._bags()
        mine = self.balancer.my_bag
        return {b: (self.balancer.groups.bag_group(mine) if gpus == mine else None)
                for b, gpus in enumerate(bags)}  # fmt: skip

    @property
    def ulysses_bag(self) -> _UlyssesBag:
        """This rank's bag for the current plan: ``pre_attn`` / ``post_attn`` as on the
        balancer, and the research code's ``bag_id``, ``gpu_ids``, ``process_group``."""
        plan = self._require_plan()
        bag_id = next(b for b, gpus in enumerate(plan.bags) if self.this_gpu_id in gpus)
        return _UlyssesBag(self, bag_id, list(plan.bags[bag_id]))

    def __getattr__(self, name: str) -> Any:
        # Only reached for names that are not regular attributes.
        if name.startswith("_"):
            raise AttributeError(name)
        if name in LEGACY_KEYS or name in PLAN_VIEWS:
            if self.balancer.last_plan is not None:
                views = self._summary_dict() if name in LEGACY_KEYS else self._plan_views()
                return views[name]
            if name in ("bag_id2gpu_ids", "gpu_id2bag_id"):  # the bags are known up front
                bags = self._bags()
                if name == "bag_id2gpu_ids":
                    return dict(enumerate(bags))
                return {g: b for b, gpus in enumerate(bags) for g in gpus}
            raise AttributeError(f"{name} is known once plan_routing(...) has been called")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # -------------------------------------------------------------- planning
    def plan_routing(
        self, local_seq_lens: Sequence[int] | torch.Tensor, token_dim: int
    ) -> RoutingPlan:
        """Plan this step (collective over the balance group); returns the `RoutingPlan`
        (the research code returned nothing)."""
        started = time.time()
        plan = self.balancer.plan_routing(local_seq_lens, token_dim)
        self._given_seq_lens = local_seq_lens
        self.metrics["start_time"] = started
        if self.tracking:
            self._track(plan, token_dim)
        return plan

    # -------------------------------------------------------------- tracking
    def turn_on_tracking(self, num_layers: int = 1, include_bwd: bool = False) -> None:
        """Keep, for every step planned from now on, the per-GPU capacity (the mean
        workload), max/min workload before and after balancing, and the step's TFLOPs for
        ``num_layers`` blocks (forward, or with ``include_bwd`` forward, backward and one
        recomputation): ``tracked_per_gpu_capacity``, ``tracked_original_imbalance_ratio``,
        ``tracked_balanced_imbalance_ratio``, ``tracked_tflops``. Starts them empty."""
        self.tracking = True
        self.num_layers, self.include_bwd = int(num_layers), bool(include_bwd)
        self._clear_tracked()

    def turn_off_tracking(self) -> None:
        """Stop tracking and drop what was tracked."""
        self.tracking = False
        self._clear_tracked()

    def print_tracking_results(self) -> str:
        """Log (INFO) the mean and standard deviation of each tracked figure over the
        tracked steps, one line each (``Per GPU Capacity: ...``, ``Original Imbalance
        Ratio: ...``, ``Balanced Imbalance Ratio: ...``, the lines the research code's
        experiment launcher reads). Returns the logged lines."""
        lines = []
        for name, label in TRACKED:
            values = np.asarray(getattr(self, name), dtype=np.float64)
            if values.size == 0:
                lines.append(f"{label}: no step tracked")
                continue
            lines.append(f"{label}: {values.mean()}, std: {values.std()}")
        for line in lines:
            logger.info(line)
        return "\n".join(lines)

    def _clear_tracked(self) -> None:
        self.tracked_tflops = []
        for name, _ in TRACKED:
            setattr(self, name, [])

    def _track(self, plan: RoutingPlan, token_dim: int) -> None:
        st = plan.stats
        self.tracked_per_gpu_capacity.append(st.mean_load)
        self.tracked_original_imbalance_ratio.append(st.max_min_before)
        self.tracked_balanced_imbalance_ratio.append(st.max_min_after)
        self.tracked_tflops.append(
            _tflops(plan.sequences.length, token_dim, self.num_layers, self.include_bwd)
        )

    def get_routing_plan_summary(self) -> dict[str, Any]:
        """The current plan as the research code's summary dict (integer ids as keys);
        ``RoutingPlan.from_legacy`` and every reader of this toolkit import it."""
        return dict(self._summary_dict())

    def print_imbalance(self) -> str:
        """Log (INFO, logger ``knapformer.compat``) each GPU's workload before and after
        balancing relative to the per-GPU capacity (the mean workload), and max/min
        workload before -> after, for the current plan. Returns the logged lines."""
        plan = self._require_plan()
        st = plan.stats
        mean = st.mean_load

        def relative(loads: np.ndarray) -> str:
            ratios = loads / mean if mean > 0 else np.zeros_like(loads)
            return " ".join(f"{g}:{r:.2f}" for g, r in zip(plan.gpus, ratios, strict=True))

        head = f"rank {self.this_gpu_id} step {plan.step}:"
        lines = [
            f"{head} per-GPU capacity {mean:.4g} (mean workload); "
            f"workload/capacity before: {relative(st.load_before)}",
            f"{head} workload/capacity after: {relative(st.load_after)}",
            f"{head} max/min workload {st.max_min_before:.4f} -> {st.max_min_after:.4f}",
        ]
        for line in lines:
            logger.info(line)
        return "\n".join(lines)

    def nice_print(self) -> None:
        """Log (INFO) every field of the routing-plan summary."""
        for key, value in self.get_routing_plan_summary().items():
            logger.info("rank %d %s: %s", self.this_gpu_id, key, value)

    # --------------------------------------------------------------- routing
    def route(
        self,
        packed_seqs: torch.Tensor,
        packed_features: Features = None,
        force_fp32_buffer: bool = False,
    ) -> tuple[tuple[int, ...], torch.Tensor, Features]:
        """Send every chunk to its GPU. ``packed_seqs``: ``(T_local, d)``; features: a
        list of ``(T_local, f)`` tensors or None. Returns ``(chunk_lens, (T_chunks, d),
        features)`` with ``chunk_lens`` a tuple of ints, as the research code returned.

        Features keep their own dtype bit for bit, so ``force_fp32_buffer`` (the research
        code's guard against bf16 rounding) has nothing to do and is ignored.
        """
        del force_fp32_buffer
        chunk_lens, seqs, features = self.balancer.route(packed_seqs, packed_features)
        return tuple(chunk_lens), seqs, features

    def reverse_route(
        self,
        packed_seqs: torch.Tensor,
        packed_features: Features = None,
        force_fp32_buffer: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, Features]:
        """Send chunks home. Returns ``(seq_lens, (T_local, d), features)``: ``seq_lens``
        is the tensor given to `plan_routing`, or (given a list) an int32 tensor of those
        lengths on the data's device. ``force_fp32_buffer`` is ignored (see `route`)."""
        del force_fp32_buffer
        _, seqs, features = self.balancer.reverse_route(packed_seqs, packed_features)
        self._update_metrics()
        given = self._given_seq_lens
        if isinstance(given, torch.Tensor):
            return given, seqs, features
        local = self.balancer.tables.local_lens  # set by the route just made
        return self._length_tensor("local", local, seqs.device), seqs, features

    def pre_attn(
        self, packed_q: torch.Tensor, packed_k: torch.Tensor, packed_v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Ulysses inside the bag: ``(T_chunks, H, D)`` each -> ``(seq_lens, q, k, v)`` with
        ``(T_bag, H/g, D)`` tensors and ``seq_lens`` an int32 tensor of the bag's whole
        sequences on their device (what ``cu_seqlens`` is made of)."""
        seq_lens, q, k, v = self.balancer.pre_attn(packed_q, packed_k, packed_v)
        return self._length_tensor("attn", seq_lens, q.device), q, k, v

    def post_attn(self, packed_seqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of `pre_attn`: ``(T_bag, H/g, D)`` -> ``(chunk_lens, (T_chunks, H, D))``
        with ``chunk_lens`` an int32 tensor on the output's device."""
        chunk_lens, out = self.balancer.post_attn(packed_seqs)
        return self._length_tensor("chunks", chunk_lens, out.device), out

    # ------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Close the recorder, if any, and destroy the sub-groups (see the balancer)."""
        self.balancer.close()

    def __enter__(self) -> SequenceBalancer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------- internals
    def _update_metrics(self) -> None:
        """The research code's figures of the step (planning to the end of reverse_route),
        and this rank's per-phase timings so far."""
        plan, now = self._require_plan(), time.time()
        total = int(plan.stats.total_tokens)
        self.metrics.update(
            end_time=now,
            total_tokens=total,
            duration_sec=now - self.metrics["start_time"],
            avg_per_gpu_tokens=total / len(plan.gpus),
        )
        self.metrics.update({f"{k}_ms": v for k, v in self.balancer.timings.items()})

    def _require_plan(self) -> RoutingPlan:
        plan = self.balancer.last_plan
        if plan is None:
            raise RuntimeError("call plan_routing(...) first: there is no routing plan yet")
        return plan

    def _of_current_plan(self) -> RoutingPlan:
        """The current plan; the views made of an earlier plan are dropped."""
        plan = self._require_plan()
        if self._views_of is not plan:
            self._views_of, self._summary, self._views, self._lengths = plan, None, None, {}
        return plan

    def _summary_dict(self) -> dict[str, Any]:
        """The current plan's legacy summary, made on first use (not every step)."""
        plan = self._of_current_plan()
        if self._summary is None:
            self._summary = plan_to_legacy(plan, json_keys=False)
        return self._summary

    def _plan_views(self) -> dict[str, Any]:
        """The current plan's `PLAN_VIEWS`, made on first use."""
        plan = self._of_current_plan()
        if self._views is None:
            self._views = _plan_views(plan, self._summary_dict(), self._local_seq_lens())
        return self._views

    def _local_seq_lens(self) -> torch.Tensor:
        """This rank's lengths as given, as an int32 tensor on the balancer's device."""
        given = self._given_seq_lens
        if isinstance(given, torch.Tensor):
            return given
        return torch.as_tensor(list(given), dtype=torch.int32, device=self.this_device)

    def _length_tensor(self, kind: str, lengths: list[int], device: torch.device) -> torch.Tensor:
        """``lengths`` as an int32 tensor on ``device``, made once per plan (a host to
        device copy per layer would otherwise be paid twice per attention call)."""
        self._of_current_plan()
        key = (kind, device)
        if key not in self._lengths:
            self._lengths[key] = torch.tensor(lengths, dtype=torch.int32, device=device)
        return self._lengths[key]


class _UlyssesBag:
    """This rank's bag of the current plan, as the research code's ``ulysses_bag``."""

    def __init__(self, owner: SequenceBalancer, bag_id: int, gpu_ids: list[int]):
        self.bag_id, self.gpu_ids, self.this_gpu_id = bag_id, gpu_ids, owner.this_gpu_id
        self.process_group = owner.balancer.groups.bag_group(gpu_ids)
        self.pre_attn, self.post_attn = owner.pre_attn, owner.post_attn


def _plan_views(plan: RoutingPlan, summary: dict[str, Any], local: torch.Tensor) -> dict[str, Any]:
    """`PLAN_VIEWS` of ``plan``; chunk ids are the summary's (consecutive per sequence)."""
    st, seqs = plan.stats, plan.sequences
    gpus = [int(g) for g in plan.gpus]
    before = {g: float(x) for g, x in zip(gpus, st.load_before, strict=True)}
    after = {g: float(x) for g, x in zip(gpus, st.load_after, strict=True)}
    capacity = st.mean_load
    bag_of_seq = {i: int(b) for i, b in enumerate(seqs.bag.tolist())}
    bag_seqs: dict[int, list[int]] = {b: [] for b in range(len(plan.bags))}
    for i, b in bag_of_seq.items():
        bag_seqs[b].append(i)
    bag_capacity = {b: capacity * len(gpus_of) for b, gpus_of in enumerate(plan.bags)}
    occupancy = {
        b: (float(st.bag_load_after[b]) / bag_capacity[b] if bag_capacity[b] > 0 else 0.0)
        for b in bag_capacity
    }
    chunk_src = {c: g for g, ids in summary["gpu_id2chunk_ids"].items() for c in ids}
    dst = summary["balance_chunk_id2gpu_id"]
    chunk_len = summary["balance_chunk_id2chunk_len"]
    on_gpu: dict[int, list[int]] = {g: [] for g in gpus}
    for c in sorted(dst):
        on_gpu[dst[c]].append(c)
    seq_of = summary["chunk_id2seq_id"]
    return {
        "local_seq_lens": local,
        "seq_id2gpu_id": {i: int(g) for i, g in enumerate(seqs.src_gpu.tolist())},
        "gpu_id2total_workload": before,
        "per_gpu_capacity": capacity,
        "seq_id2assigned_bag_id": bag_of_seq,
        "bag_id2capacity": bag_capacity,
        "bag_id2assigned_seq_ids": bag_seqs,
        "bag_id2occupancy": occupancy,
        "chunk_id2gpu_id": dict(sorted(chunk_src.items())),
        "chunk_id2chunk_len": dict(sorted(chunk_len.items())),
        "balance_gpu_id2chunk_ids": on_gpu,
        "balance_gpu_id2chunk_lens": {g: [chunk_len[c] for c in ids] for g, ids in on_gpu.items()},
        "balance_gpu_id2seq_ids": {
            g: sorted({seq_of[c] for c in ids}) for g, ids in on_gpu.items()
        },
        "balance_gpu_id2total_workload": after,
        "orig_minmax_workload": (min(before.values()), max(before.values())),
        "bala_minmax_workload": (min(after.values()), max(after.values())),
    }
