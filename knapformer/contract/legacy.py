"""Import and export the original research code's routing-plan summary.

The research code's ``get_routing_plan_summary()`` returns dicts keyed by integer ids;
saved with ``json.dump`` the keys become strings. It carries no topology string, token
dimension or gamma: the topology is inferred from the bag sizes and the rest is marked
unknown (``None`` / solver ``"unknown"``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from knapformer.contract.limits import MAX_RANK, MAX_SEQ_LENGTH, abbreviate
from knapformer.contract.plan import RoutingPlan
from knapformer.contract.topology import Topology
from knapformer.errors import KnapformerError

#: Every key of the summary, in the order the research code writes them (`plan_to_legacy`
#: writes them all; `knapformer.compat` serves them as attributes).
LEGACY_KEYS = (
    "balance_gpu_ids",
    "bag_id2gpu_ids",
    "gpu_id2bag_id",
    "seq_id2seq_len",
    "seq_id2seq_workload",
    "gpu_id2seq_ids",
    "gpu_id2seq_lens",
    "gpu_id2seq_workloads",
    "gpu_id2chunk_ids",
    "gpu_id2chunk_lens",
    "balance_chunk_id2gpu_id",
    "balance_chunk_id2chunk_len",
    "chunk_id2seq_id",
)
#: What an import needs of them.
_REQUIRED = (
    "balance_gpu_ids",
    "bag_id2gpu_ids",
    "seq_id2seq_len",
    "gpu_id2seq_ids",
    "gpu_id2chunk_ids",
    "balance_chunk_id2gpu_id",
    "balance_chunk_id2chunk_len",
    "chunk_id2seq_id",
)


def is_legacy(record: Any) -> bool:
    return isinstance(record, dict) and "balance_gpu_ids" in record and "topology" not in record


def _bounded(value: Any, what: str, bound: int = MAX_RANK) -> int:
    """``value`` (an int, a whole float or a decimal string) as an int in ``0..bound``.

    Legacy ids and lengths are bounded before numpy sees them: an int beyond int64 would
    overflow (or wrap around) there."""
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise KnapformerError(f"legacy plan: {what} {abbreviate(repr(value))} is not an integer")
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        raise KnapformerError(
            f"legacy plan: {what} {abbreviate(repr(value))} is not an integer"
        ) from None
    if not 0 <= number <= bound:
        raise KnapformerError(
            f"legacy plan: {what} {abbreviate(f'{number:,}')} is outside 0..{bound:,} "
            "(knapformer.contract.limits)"
        )
    return number


def _int_keyed(mapping: dict, name: str) -> dict[int, Any]:
    if not isinstance(mapping, dict):
        raise KnapformerError(f"legacy plan: {name} must be an object keyed by id")
    return {_bounded(k, f"{name} has a key"): v for k, v in mapping.items()}


def plan_from_legacy(summary: dict) -> RoutingPlan:
    """Build (and validate) a `RoutingPlan` from a legacy summary dict.

    Malformed input raises `KnapformerError` (pydantic's ``ValidationError`` for a broken
    invariant) naming what is wrong, never a bare ``KeyError``/``TypeError``.
    """
    try:
        return _plan_from_legacy(summary)
    except KeyError as err:
        raise KnapformerError(
            f"legacy plan: id {err.args[0]!r} is referenced but not described"
        ) from err
    except (TypeError, AttributeError, IndexError, OverflowError) as err:
        raise KnapformerError(f"legacy plan: a field has the wrong shape ({err})") from err


def _plan_from_legacy(summary: dict) -> RoutingPlan:
    missing = [k for k in _REQUIRED if k not in summary]
    if missing:
        raise KnapformerError(f"legacy plan is missing key(s): {', '.join(missing)}")
    gpus = [_bounded(g, "GPU id") for g in summary["balance_gpu_ids"]]
    bag_map = _int_keyed(summary["bag_id2gpu_ids"], "bag_id2gpu_ids")
    bags = [[_bounded(g, "GPU id") for g in bag_map[b]] for b in sorted(bag_map)]
    seq_len = _int_keyed(summary["seq_id2seq_len"], "seq_id2seq_len")
    seq_work = _int_keyed(summary.get("seq_id2seq_workload", {}), "seq_id2seq_workload")
    gpu_seqs = _int_keyed(summary["gpu_id2seq_ids"], "gpu_id2seq_ids")
    gpu_chunks = _int_keyed(summary["gpu_id2chunk_ids"], "gpu_id2chunk_ids")
    chunk_dst = _int_keyed(summary["balance_chunk_id2gpu_id"], "balance_chunk_id2gpu_id")
    chunk_len = _int_keyed(summary["balance_chunk_id2chunk_len"], "balance_chunk_id2chunk_len")
    chunk_seq = _int_keyed(summary["chunk_id2seq_id"], "chunk_id2seq_id")

    # Sequences in order of their source GPU (gpus order), then their order there.
    old_seq_ids, seq_src = [], []
    for gpu in gpus:
        for sid in gpu_seqs.get(gpu, []):
            old_seq_ids.append(_bounded(sid, "sequence id"))
            seq_src.append(gpu)
    seq_index = {sid: i for i, sid in enumerate(old_seq_ids)}
    for sid in seq_len:
        if sid not in seq_index:
            raise KnapformerError(f"legacy plan: sequence {sid} is on no GPU in gpu_id2seq_ids")

    old_chunk_ids, chunk_src = [], []
    for gpu in gpus:
        for cid in gpu_chunks.get(gpu, []):
            old_chunk_ids.append(_bounded(cid, "chunk id"))
            chunk_src.append(gpu)
    try:
        c_seq = [seq_index[_bounded(chunk_seq[c], "sequence id")] for c in old_chunk_ids]
        c_len = [_bounded(chunk_len[c], "chunk length", MAX_SEQ_LENGTH) for c in old_chunk_ids]
        c_dst = [_bounded(chunk_dst[c], "GPU id") for c in old_chunk_ids]
    except KeyError as err:
        raise KnapformerError(
            f"legacy plan: chunk or sequence id {err.args[0]} is not described"
        ) from err
    # A sequence's chunks have consecutive ids and tile it in id order.
    order = np.argsort(np.asarray(old_chunk_ids, dtype=np.int64), kind="stable")
    offsets = np.zeros(len(old_chunk_ids), dtype=np.int64)
    running: dict[int, int] = {}
    for i in order.tolist():
        s = c_seq[i]
        offsets[i] = running.get(s, 0)
        running[s] = offsets[i] + c_len[i]

    # Canonical chunk order: by sequence, then offset.
    order = np.lexsort((offsets, np.asarray(c_seq, dtype=np.int64)))
    c_seq = [c_seq[i] for i in order]
    c_len = [c_len[i] for i in order]
    c_dst = [c_dst[i] for i in order]
    chunk_src = [chunk_src[i] for i in order]
    offsets = offsets[order]

    bag_of_gpu = {g: b for b, members in enumerate(bags) for g in members}
    seq_bag = [-1] * len(old_seq_ids)
    for s, dst in zip(c_seq, c_dst, strict=True):
        seq_bag[s] = bag_of_gpu.get(dst, -1)
    for i in range(len(old_seq_ids)):
        if seq_bag[i] < 0:  # a zero-length sequence has no chunk: keep it at home
            seq_bag[i] = bag_of_gpu.get(seq_src[i], 0)

    return RoutingPlan.model_validate(
        {
            "topology": str(Topology.from_bag_sizes([len(b) for b in bags])),
            "gpus": gpus,
            "bags": bags,
            "token_dim": None,
            "gamma": None,
            "solver": "unknown",
            "sequences": {
                "src_gpu": seq_src,
                "length": [
                    _bounded(seq_len[s], "sequence length", MAX_SEQ_LENGTH) for s in old_seq_ids
                ],
                "workload": [float(seq_work.get(s, 0.0)) for s in old_seq_ids],
                "bag": seq_bag,
            },
            "chunks": {
                "seq": c_seq,
                "src_gpu": chunk_src,
                "dst_gpu": c_dst,
                "offset": offsets.tolist(),
                "length": c_len,
            },
        }
    )


def plan_to_legacy(plan: RoutingPlan, json_keys: bool = True) -> dict:
    """The legacy summary of a plan.

    Ids are keys of the inner dicts: integers as the research code's
    ``get_routing_plan_summary()`` returns them (``json_keys=False``), or strings as
    ``json.dump`` leaves them (the default, what a saved summary holds).
    """
    seqs, chunks = plan.sequences, plan.chunks
    bag_of_gpu = {g: b for b, members in enumerate(plan.bags) for g in members}
    out: dict[str, Any] = {
        "balance_gpu_ids": list(plan.gpus),
        "bag_id2gpu_ids": {b: list(m) for b, m in enumerate(plan.bags)},
        "gpu_id2bag_id": {g: bag_of_gpu[g] for g in plan.gpus},
        "seq_id2seq_len": {i: int(x) for i, x in enumerate(seqs.length)},
        "seq_id2seq_workload": {i: float(x) for i, x in enumerate(seqs.workload)},
    }
    by_gpu_seq: dict[int, list] = {g: [] for g in plan.gpus}
    for i, g in enumerate(seqs.src_gpu.tolist()):
        by_gpu_seq[g].append(i)
    out["gpu_id2seq_ids"] = by_gpu_seq
    out["gpu_id2seq_lens"] = {
        g: [int(seqs.length[i]) for i in ids] for g, ids in by_gpu_seq.items()
    }
    out["gpu_id2seq_workloads"] = {
        g: [float(seqs.workload[i]) for i in ids] for g, ids in by_gpu_seq.items()
    }
    # Legacy chunk ids: consecutive per sequence, in offset order.
    order = np.lexsort((chunks.offset, chunks.seq))
    new_id = np.empty(len(order), dtype=np.int64)
    new_id[order] = np.arange(len(order))
    by_gpu_chunk: dict[int, list] = {g: [] for g in plan.gpus}
    for c in order.tolist():
        by_gpu_chunk[int(chunks.src_gpu[c])].append(int(new_id[c]))
    out["gpu_id2chunk_ids"] = by_gpu_chunk
    out["gpu_id2chunk_lens"] = {
        g: [int(chunks.length[order[c]]) for c in ids] for g, ids in by_gpu_chunk.items()
    }
    out["balance_chunk_id2gpu_id"] = {
        int(new_id[c]): int(chunks.dst_gpu[c]) for c in range(len(order))
    }
    out["balance_chunk_id2chunk_len"] = {
        int(new_id[c]): int(chunks.length[c]) for c in range(len(order))
    }
    out["chunk_id2seq_id"] = {int(new_id[c]): int(chunks.seq[c]) for c in range(len(order))}
    if json_keys:
        return {k: _str_keys(v) for k, v in out.items()}
    return out


def _str_keys(value: Any) -> Any:
    return {str(k): v for k, v in value.items()} if isinstance(value, dict) else value
