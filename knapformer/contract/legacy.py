"""Import and export the original research code's routing-plan summary.

The research code's ``get_routing_plan_summary()`` returns dicts keyed by integer ids;
saved with ``json.dump`` the keys become strings. It carries no topology string, token
dimension or gamma: the topology is inferred from the bag sizes and the rest is marked
unknown (``None`` / solver ``"unknown"``).

The summary says most things twice (a GPU's bag in ``gpu_id2bag_id`` and in
``bag_id2gpu_ids``, lengths per sequence and per GPU, ...). An import checks that the
copies agree and refuses a summary that contradicts itself, naming both sides.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from knapformer.contract.alignment import fixed_layout_problem
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
    """``value`` (an int, a whole float or a decimal string as ``json.dump`` writes an int
    key: no sign, spaces or leading zeros) as an int in ``0..bound``.

    Legacy ids and lengths are bounded before numpy sees them: an int beyond int64 would
    overflow (or wrap around) there."""
    not_int = f"legacy plan: {what} {abbreviate(repr(value))} is not an integer"
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise KnapformerError(not_int)
    if isinstance(value, str) and not (
        value.isascii() and value.isdigit() and (value == "0" or not value.startswith("0"))
    ):
        raise KnapformerError(not_int + " (ids are written as plain decimal numbers)")
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        raise KnapformerError(not_int) from None
    if not 0 <= number <= bound:
        raise KnapformerError(
            f"legacy plan: {what} {abbreviate(f'{number:,}')} is outside 0..{bound:,} "
            "(knapformer.contract.limits)"
        )
    return number


def _int_keyed(mapping: dict, name: str) -> dict[int, Any]:
    if not isinstance(mapping, dict):
        raise KnapformerError(f"legacy plan: {name} must be an object keyed by id")
    out: dict[int, Any] = {}
    keys: dict[int, Any] = {}
    for key, value in mapping.items():
        number = _bounded(key, f"{name} key")
        if number in out:  # 1 and "1" in a dict built in Python
            raise KnapformerError(
                f"legacy plan: {name} names id {number} twice ({abbreviate(repr(keys[number]))} "
                f"and {abbreviate(repr(key))})"
            )
        out[number], keys[number] = value, key
    return out


def _listed_once(per_gpu: dict[int, Any], gpus: list[int], name: str, what: str) -> None:
    """Each id of ``per_gpu`` (GPU -> list of ids) on one GPU of ``gpus``, once."""
    known = set(gpus)
    where: dict[int, int] = {}
    for gpu, ids in per_gpu.items():
        if gpu not in known and ids:
            raise KnapformerError(
                f"legacy plan: {name} lists {what}s on GPU {gpu}, which is not in balance_gpu_ids"
            )
        for raw in ids:
            i = _bounded(raw, f"{what} id")
            if i in where:
                first = where[i]
                places = f"GPUs {first} and {gpu}" if first != gpu else f"GPU {gpu} twice"
                raise KnapformerError(f"legacy plan: {what} {i} is listed on {places} in {name}")
            where[i] = gpu


def _described_but_unlisted(listed: set[int], maps: dict[str, dict[int, Any]], what: str) -> None:
    """Every id described by one of ``maps`` (name -> id-keyed map) is listed on a GPU."""
    for name, mapping in maps.items():
        stray = next((i for i in mapping if i not in listed), None)
        if stray is not None:
            raise KnapformerError(
                f"legacy plan: {what} {stray} is described in {name} but listed on no GPU"
            )


def _per_gpu_agrees(
    summary: dict, name: str, per_gpu_ids: dict[int, list], value_of: dict[int, Any], by: str
) -> None:
    """The optional per-GPU copy ``summary[name]`` (GPU -> values, in the order of the
    GPU's ids) agrees with ``value_of`` (id -> value, from the field ``by``)."""
    if name not in summary:
        return
    copy = _int_keyed(summary[name], name)
    for gpu, ids in per_gpu_ids.items():
        given = copy.get(gpu, [])
        if not isinstance(given, list) or len(given) != len(ids):
            count = len(given) if isinstance(given, list) else abbreviate(repr(given))
            raise KnapformerError(
                f"legacy plan: {name} of GPU {gpu} holds {count} values for its {len(ids)} ids"
            )
        for i, value in zip(ids, given, strict=True):
            expected = value_of.get(_bounded(i, "id"))
            if not _same_number(value, expected):
                raise KnapformerError(
                    f"legacy plan: {name} of GPU {gpu} says {abbreviate(repr(value))} for id "
                    f"{i}, {by} says {abbreviate(repr(expected))}"
                )
    stray = next((g for g, v in copy.items() if g not in per_gpu_ids and v), None)
    if stray is not None:
        raise KnapformerError(f"legacy plan: {name} holds values for GPU {stray}, which has none")


def _same_number(a: Any, b: Any) -> bool:
    numbers = (int, float)
    if isinstance(a, bool) or isinstance(b, bool):
        return False
    if not (isinstance(a, numbers) and isinstance(b, numbers)):
        return False
    return a == b or abs(a - b) <= 1e-9 * max(abs(a), abs(b))


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
    _listed_once(gpu_seqs, gpus, "gpu_id2seq_ids", "sequence")
    _listed_once(gpu_chunks, gpus, "gpu_id2chunk_ids", "chunk")
    seq_index = {sid: i for i, sid in enumerate(old_seq_ids)}
    for sid in seq_len:
        if sid not in seq_index:
            raise KnapformerError(f"legacy plan: sequence {sid} is on no GPU in gpu_id2seq_ids")
    _described_but_unlisted(set(seq_index), {"seq_id2seq_workload": seq_work}, "sequence")

    old_chunk_ids, chunk_src = [], []
    for gpu in gpus:
        for cid in gpu_chunks.get(gpu, []):
            old_chunk_ids.append(_bounded(cid, "chunk id"))
            chunk_src.append(gpu)
    _described_but_unlisted(
        set(old_chunk_ids),
        {
            "balance_chunk_id2gpu_id": chunk_dst,
            "balance_chunk_id2chunk_len": chunk_len,
            "chunk_id2seq_id": chunk_seq,
        },
        "chunk",
    )
    try:
        c_seq = [seq_index[_bounded(chunk_seq[c], "sequence id")] for c in old_chunk_ids]
        c_len = [_bounded(chunk_len[c], "chunk length", MAX_SEQ_LENGTH) for c in old_chunk_ids]
        c_dst = [_bounded(chunk_dst[c], "GPU id") for c in old_chunk_ids]
    except KeyError as err:
        raise KnapformerError(
            f"legacy plan: chunk or sequence id {err.args[0]} is not described"
        ) from err
    # After the ids and lengths are bounded: a contradiction names the values as numbers.
    _agrees_with_itself(summary, gpus, bag_map, gpu_seqs, gpu_chunks, seq_len, seq_work, chunk_len)
    _chunks_cover_lengths(old_seq_ids, seq_len, c_seq, c_len)
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

    topology = Topology.from_bag_sizes([len(b) for b in bags])
    return RoutingPlan.model_validate(
        {
            "topology": str(topology),
            # Bags not where the topology lays them were chosen for the step (an exported
            # auto plan): validated, and replayed, as the planner's choice.
            "policy": None if fixed_layout_problem(topology, gpus, bags) is None else "auto",
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


def _agrees_with_itself(
    summary: dict,
    gpus: list[int],
    bag_map: dict[int, Any],
    gpu_seqs: dict[int, list],
    gpu_chunks: dict[int, list],
    seq_len: dict[int, Any],
    seq_work: dict[int, Any],
    chunk_len: dict[int, Any],
) -> None:
    """The optional copies of the summary agree with the fields the import is built from."""
    if "gpu_id2bag_id" in summary:
        said = _int_keyed(summary["gpu_id2bag_id"], "gpu_id2bag_id")
        bag_of = {_bounded(g, "GPU id"): b for b, members in bag_map.items() for g in members}
        for gpu, bag in said.items():
            if gpu not in bag_of:
                raise KnapformerError(
                    f"legacy plan: gpu_id2bag_id puts GPU {gpu} in bag {abbreviate(repr(bag))}, "
                    "but no bag of bag_id2gpu_ids holds it"
                )
            if _bounded(bag, "bag id") != bag_of[gpu]:
                raise KnapformerError(
                    f"legacy plan: gpu_id2bag_id puts GPU {gpu} in bag {bag}, bag_id2gpu_ids "
                    f"in bag {bag_of[gpu]}"
                )
        missing = next((g for g in gpus if g not in said), None)
        if missing is not None:
            raise KnapformerError(f"legacy plan: gpu_id2bag_id gives no bag for GPU {missing}")
    _per_gpu_agrees(summary, "gpu_id2seq_lens", gpu_seqs, seq_len, "seq_id2seq_len")
    if "seq_id2seq_workload" in summary:
        _per_gpu_agrees(summary, "gpu_id2seq_workloads", gpu_seqs, seq_work, "seq_id2seq_workload")
    _per_gpu_agrees(
        summary, "gpu_id2chunk_lens", gpu_chunks, chunk_len, "balance_chunk_id2chunk_len"
    )


def _chunks_cover_lengths(
    old_seq_ids: list[int], seq_len: dict[int, Any], c_seq: list[int], c_len: list[int]
) -> None:
    """Each sequence's chunk lengths sum to its length in ``seq_id2seq_len``."""
    covered = np.bincount(
        np.asarray(c_seq, dtype=np.int64),
        weights=np.asarray(c_len, dtype=np.float64),
        minlength=len(old_seq_ids),
    )
    for i, sid in enumerate(old_seq_ids):
        length = _bounded(seq_len[sid], "sequence length", MAX_SEQ_LENGTH)
        if int(covered[i]) != length:
            raise KnapformerError(
                f"legacy plan: sequence {sid} is {length:,} tokens in seq_id2seq_len, but its "
                f"chunks in balance_chunk_id2chunk_len sum to {int(covered[i]):,}"
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
