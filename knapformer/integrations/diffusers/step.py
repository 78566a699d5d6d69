"""One packed step of a declared diffusers model: capture each sample's block inputs at
home, agree on their shapes, route the tokens, run every block once on the rows this
rank computes, bring the result home, and let the model finish each sample.

Shapes: a sample's joint sequence has ``L`` rows of width ``D`` (its streams joined);
this rank's samples hold ``T_local`` rows, the routed chunks ``T`` rows; ``S_held``
samples have rows here. See docs/diffusers.md for the whole picture.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from knapformer.errors import KnapformerError
from knapformer.integrations.diffusers.capture import (
    block_signature,
    call_block,
    capture,
    finish,
)
from knapformer.integrations.diffusers.declarations import JOINT, ModelSpec
from knapformer.integrations.diffusers.inputs import (
    SampleInputs,
    Signature,
    block_arguments,
    sort_inputs,
)
from knapformer.integrations.diffusers.layouts import StepLayouts, activated
from knapformer.integrations.diffusers.per_sample import PerSample
from knapformer.runtime.conditioning import gather_sequences
from knapformer.runtime.router import host_to_device, token_ranges

if TYPE_CHECKING:
    from knapformer.runtime.balancer import SequenceBalancer


def prepare(
    model, spec: ModelSpec, samples: list[dict]
) -> tuple[list[SampleInputs], Signature | None]:
    """Each sample's block inputs, captured at home, and their common signature."""
    prepared, signature = [], None
    for i, sample in enumerate(samples):
        inputs, sig = sort_inputs(spec, capture(model, spec, sample))
        if signature is None:
            signature = sig
        elif sig.comparable(spec.ignored) != signature.comparable(spec.ignored):
            raise KnapformerError(
                f"sample {i}'s block inputs differ from sample 0's in shape, dtype or a "
                f"setting: {_difference(sig, signature)}"
            )
        prepared.append(inputs)
    return prepared, signature


def _difference(a: Signature, b: Signature) -> str:
    for per_a, per_b in zip(a.arguments, b.arguments, strict=False):
        for (name, _, la), (_, _, lb) in zip(per_a, per_b, strict=False):
            if la != lb:
                return f"block argument {name!r}"
    if a.values != b.values:
        return f"per-sample values {a.values} against {b.values} (pad prompts to one length)"
    return "token features or width"


def agree(
    balancer: SequenceBalancer, spec: ModelSpec, signature: Signature | None,
    lengths: list[tuple[int, ...]],
) -> tuple[Signature, list[list[tuple[int, ...]]]]:  # fmt: skip
    """Collective over the balance group: the step's signature (a rank without samples
    takes its peers') and every rank's samples' stream lengths, by group position."""
    got: list[Any] = [None] * len(balancer.group_ranks)
    dist.all_gather_object(got, (signature, lengths), group=balancer.group)
    sigs = [s for s, _ in got if s is not None]
    if not sigs:
        raise KnapformerError("no rank of the balance group has a sample this step")
    mine = sigs[0].comparable(spec.ignored)
    for rank, (s, _) in zip(balancer.group_ranks, got, strict=True):
        if s is not None and s.comparable(spec.ignored) != mine:
            raise KnapformerError(
                f"rank {rank}'s block inputs differ from the group's first in shape, dtype "
                f"or a setting: {_difference(s, sigs[0])}"
            )
    return sigs[0], [list(lens) for _, lens in got]


def placement(balancer: SequenceBalancer, lengths_by_rank: list[list[tuple[int, ...]]]):
    """Host-side facts of the rows routed here: ``(row_stream, row_sample, held,
    sequences)`` (see `StepLayouts`; ``held``: the plan sequence ids held, ascending)."""
    plan = balancer.last_plan
    position = {int(g): i for i, g in enumerate(plan.gpus)}
    taken = [0] * len(plan.gpus)
    per_seq = []
    for src in np.asarray(plan.sequences.src_gpu, dtype=np.int64):
        p = position[int(src)]
        per_seq.append(tuple(lengths_by_rank[p][taken[p]]))
        taken[p] += 1
    # This rank's rows of the chunk table only (a plan made here derives the whole table
    # when a reader reads it): the chunks routed to it and those of its bag.
    into_bag = plan.chunks_into_bag(plan.bag_of(balancer.rank))
    mine = into_bag.where(into_bag.dst_gpu == balancer.rank)
    row_seq = np.repeat(mine.seq, mine.length)
    row_pos = token_ranges(mine.offset, mine.length)
    in_bag = np.unique(into_bag.seq)
    return (*_rows(per_seq, row_seq, row_pos), [per_seq[i] for i in in_bag])


def local_placement(lengths: list[tuple[int, ...]]):
    """`placement` without a balancer: this rank's samples, where they are."""
    totals = np.asarray([sum(x) for x in lengths], np.int64)
    row_seq = np.repeat(np.arange(len(lengths)), totals)
    row_pos = token_ranges(np.zeros(len(lengths), np.int64), totals)
    return (*_rows(lengths, row_seq, row_pos), list(lengths))


def _rows(per_seq, row_seq: np.ndarray, row_pos: np.ndarray):
    if not len(row_seq):
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    bounds = np.cumsum(np.asarray(per_seq, dtype=np.int64), axis=1)[:, :-1]
    row_stream = (row_pos[:, None] >= bounds[row_seq]).sum(axis=1)
    held, row_sample = np.unique(row_seq, return_inverse=True)
    return row_stream, row_sample, held


def local_tensors(prepared: list[SampleInputs], signature: Signature, device):
    """This rank's ``(T_local, D)`` rows, features ``(T_local, ...)`` and per-sample
    values ``(S_local, ...)`` (empty ones of the signature's shapes when it has none)."""
    if prepared:
        x = torch.cat([p.joint for p in prepared])
        feats = [
            torch.cat([p.features[i] for p in prepared]) for i in range(len(signature.features))
        ]
        values = [torch.cat([p.values[i] for p in prepared]) for i in range(len(signature.values))]
        return x, feats, values
    # As the peers' in dtype and in requiring grad: the backward of route and of the
    # per-sample gather is collective, and runs only where its input requires grad.
    x = torch.zeros(0, signature.width, dtype=signature.dtype, device=device,
                    requires_grad=signature.grad)  # fmt: skip
    feats = [torch.zeros(0, *shape, dtype=dtype, device=device)
             for shape, dtype, _, _ in signature.features]  # fmt: skip
    values = [torch.zeros(0, *shape[1:], dtype=dtype, device=device, requires_grad=grad)
              for shape, dtype, grad in signature.values]  # fmt: skip
    return x, feats, values


def held_values(balancer, values: list[torch.Tensor], held: np.ndarray) -> list[PerSample]:
    """This rank's per-sample values -> those of the samples held here."""
    if balancer is None:
        return [PerSample.of(v) for v in values]
    held = held if len(held) else np.zeros(1, np.int64)  # spares need a sample (layouts)
    index = host_to_device(torch.from_numpy(held.astype(np.int64)), balancer.device)
    return [PerSample.of(gather_sequences(balancer, v).index_select(0, index)) for v in values]


class _Streams:
    """The current token streams ``(1, n, D)``, each alone or joined (a stream of
    None: a block returned none, e.g. SD3's last block for the text)."""

    def __init__(self, order: tuple[str, ...], streams: dict[str, torch.Tensor]):
        self.order, self.alone, self.joined = order, dict(streams), None
        self.sizes = [streams[s].shape[1] for s in order]

    def get(self, name: str) -> torch.Tensor | None:
        if name == JOINT:
            if self.joined is None:
                self.joined = torch.cat([self.alone[s] for s in self.order], dim=1)
            return self.joined
        if not self.alone:
            self.alone = dict(zip(self.order, self.joined.split(self.sizes, dim=1), strict=True))
        return self.alone[name]

    def set(self, name: str, value: torch.Tensor | None) -> None:
        if name == JOINT:
            self.joined, self.alone = value, {}
        else:
            self.get(name)
            self.alone[name], self.joined = value, None


def run_blocks(
    model, spec: ModelSpec, layouts: StepLayouts, x: torch.Tensor,
    features: list[torch.Tensor], values: list[PerSample], signature: Signature,
):  # fmt: skip
    """Every block of the model, once, on the routed rows ``x (T, D)``: -> the final
    streams ``{name: (1, n, D) | None}``."""
    streams = _Streams(spec.streams, {s: t[None] for s, t in layouts.split(x).items()})
    checkpointed = bool(getattr(model, "gradient_checkpointing", False)) and torch.is_grad_enabled()
    with activated(layouts):
        for b, arguments in zip(spec.blocks, signature.arguments, strict=True):
            common = block_arguments(arguments, {}, features, values, layouts, signature)
            sig = block_signature(model, b.name)
            for block in model.get_submodule(b.name):
                # A new dict per block: a checkpointed block recomputes from its own.
                kwargs = {**common, **{a: streams.get(s) for a, s in b.streams.items()}}
                if checkpointed:
                    out = checkpoint(_in_step, layouts, block, sig, kwargs, use_reentrant=False)
                else:
                    out = call_block(block, sig, kwargs)
                out = out if isinstance(out, tuple) else (out,)
                for name, value in zip(b.returns, out, strict=False):
                    if name is not None:
                        streams.set(b.streams[name], value)
    return {s: streams.get(s) for s in spec.streams}


def _in_step(layouts: StepLayouts, block, sig, kwargs):
    """`call_block` with the step's layouts active: a checkpointed block is recomputed in
    backward, after the forward left the step."""
    with activated(layouts):
        return call_block(block, sig, kwargs)


def home_rows(balancer, layouts: StepLayouts, finals: dict, spec: ModelSpec) -> torch.Tensor:
    """The declared output stream's rows, back home: ``(T_local, D)`` in local joint order
    (the other streams' rows are zeros)."""
    out = finals[spec.output]
    if out is None:
        raise KnapformerError(f"the blocks returned no {spec.output} stream")
    routed = layouts.merge({spec.output: out[0]}, out[0])
    if balancer is None:
        return routed
    return balancer.reverse_route(routed)[1]


def sample_outputs(model, spec: ModelSpec, samples: list[dict], prepared: list[SampleInputs],
                   home: torch.Tensor) -> list[torch.Tensor]:  # fmt: skip
    """Each sample's output, the model finishing it from its rows of ``home``."""
    which = spec.streams.index(spec.output)
    outs, start = [], 0
    for sample, p in zip(samples, prepared, strict=True):
        begin = start + sum(p.lengths[:which])
        final = home[begin : begin + p.lengths[which]][None]
        outs.append(finish(model, spec, sample, final))
        start += sum(p.lengths)
    return outs
