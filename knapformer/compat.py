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

What it keeps from the original: the constructor ``(bag_specs, gamma=1.0)`` and its
solver (greedy, the published algorithm; ours defaults to γ 0.4 and our own solver), the
length types each call returns (a tuple of ints from `route`, int32 tensors on the data's
device from `pre_attn` / `post_attn`, the caller's own lengths from `reverse_route`),
`print_imbalance`, `nice_print`, `get_routing_plan_summary` and the summary's fields as
attributes (``balancer.gpu_id2seq_lens[balancer.this_gpu_id]``, as MMDiT integrations
read them). Everything runs on `knapformer.runtime.balancer.SequenceBalancer` (``.balancer``),
so gloo works as well as NCCL, ``last_plan`` is a `RoutingPlan`, and keyword-only
options (``solver``, ``recorder``, ``run``, ...) reach the rest of the toolkit.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from knapformer.contract.legacy import LEGACY_KEYS, plan_to_legacy
from knapformer.contract.plan import RoutingPlan
from knapformer.contract.topology import Topology
from knapformer.planning.workload import WorkloadModel
from knapformer.runtime.balancer import SequenceBalancer as _Balancer
from knapformer.runtime.router import Features, Group

logger = logging.getLogger(__name__)

# The research code's defaults: attention weighed fully, sequences placed greedily.
ORIGINAL_GAMMA = 1.0
ORIGINAL_SOLVER = "greedy"

# What the research code had that this layer does not provide, and where to look instead.
_NOT_PROVIDED = {
    "turn_on_tracking": "record plans with recorder=knapformer.PlanRecorder(...) and read "
    "their figures with `knapformer show` or plan.stats",
    "turn_off_tracking": "pass no recorder",
    "print_tracking_results": "run `knapformer show` on the recorded plans",
    "tracked_tflops": "see plan.stats.total_load of each recorded plan",
    "metrics": "see balancer.timings and plan.measurements",
    "ulysses_bag": "pre_attn / post_attn do the Ulysses exchange",
}


def workload_estimator(seq_len: int, d: int, gamma: float = ORIGINAL_GAMMA) -> float:
    """Workload of one sequence of ``seq_len`` tokens and token dimension ``d`` (the
    research code's function, γ 1.0 by default); `WorkloadModel.workload` computes it."""
    return float(WorkloadModel(int(d), gamma).workload(seq_len))


class SequenceBalancer:
    """The research code's balancer interface, backed by `knapformer.runtime.balancer`.

    Args:
        bag_specs: compute bags, e.g. ``"g1n2+g2n1+g4n1"``.
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
        self._lengths: dict[tuple[str, torch.device], torch.Tensor] = {}

    # ------------------------------------------------------------ attributes
    @property
    def gamma(self) -> float:
        return self.balancer.gamma

    @property
    def solver(self) -> str:
        return self.balancer.solver

    @property
    def topology(self) -> Topology:
        return self.balancer.topology

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

    def __getattr__(self, name: str) -> Any:
        # Only reached for names that are not regular attributes.
        if name in LEGACY_KEYS:
            if self.balancer.last_plan is None:
                raise AttributeError(f"{name} is known once plan_routing(...) has been called")
            return self._summary_dict()[name]
        if name in _NOT_PROVIDED:
            raise AttributeError(
                f"knapformer.compat.SequenceBalancer has no {name!r}: {_NOT_PROVIDED[name]}"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # -------------------------------------------------------------- planning
    def plan_routing(
        self, local_seq_lens: Sequence[int] | torch.Tensor, token_dim: int
    ) -> RoutingPlan:
        """Plan this step (collective over the balance group); returns the `RoutingPlan`
        (the research code returned nothing)."""
        plan = self.balancer.plan_routing(local_seq_lens, token_dim)
        self._given_seq_lens = local_seq_lens
        return plan

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
    def _require_plan(self) -> RoutingPlan:
        plan = self.balancer.last_plan
        if plan is None:
            raise RuntimeError("call plan_routing(...) first: there is no routing plan yet")
        return plan

    def _of_current_plan(self) -> RoutingPlan:
        """The current plan; the views made of an earlier plan are dropped."""
        plan = self._require_plan()
        if self._views_of is not plan:
            self._views_of, self._summary, self._lengths = plan, None, {}
        return plan

    def _summary_dict(self) -> dict[str, Any]:
        """The current plan's legacy summary, made on first use (not every step)."""
        plan = self._of_current_plan()
        if self._summary is None:
            self._summary = plan_to_legacy(plan, json_keys=False)
        return self._summary

    def _length_tensor(self, kind: str, lengths: list[int], device: torch.device) -> torch.Tensor:
        """``lengths`` as an int32 tensor on ``device``, made once per plan (a host to
        device copy per layer would otherwise be paid twice per attention call)."""
        self._of_current_plan()
        key = (kind, device)
        if key not in self._lengths:
            self._lengths[key] = torch.tensor(lengths, dtype=torch.int32, device=device)
        return self._lengths[key]
