"""Baseline: a plain-Python transcription of the published greedy algorithm.

State lives in per-sequence and per-bag dictionaries, one Python object per row, the
way the algorithm reads on paper. It is the side-by-side baseline of
``bench/planner.py`` and, in the tests, the reference that ``solver="greedy"`` must
reproduce exactly.
"""

from __future__ import annotations


def greedy_plan_python(
    lengths_per_gpu: list[list[int]], bag_sizes: list[int], token_dim: int, gamma: float
) -> dict:
    """Returns {"sequences": {id: {...}}, "chunks": [{...}, ...]} for one balance group."""
    d = float(token_dim)
    seqs = {}
    for gpu, lengths in enumerate(lengths_per_gpu):
        for length in lengths:
            length = int(length)
            workload = (24.0 * length * d * d + gamma * 4.0 * length * length * d) / 1e12
            seqs[len(seqs)] = {"src_gpu": gpu, "length": length, "workload": workload}

    num_gpus = sum(bag_sizes)
    gpu_capacity = sum(s["workload"] for s in seqs.values()) / num_gpus
    bags, start = [], 0
    for bag_id, size in enumerate(sorted(bag_sizes)):
        bags.append(
            {
                "id": bag_id,
                "gpus": list(range(start, start + size)),
                "size": size,
                "capacity": size * gpu_capacity,
                "load": 0.0,
                "round_robin": 0,
            }
        )
        start += size
    largest = max(b["size"] for b in bags)

    order = sorted(seqs, key=lambda sid: (-seqs[sid]["workload"], sid))
    for sid in order:
        seq = seqs[sid]
        candidates = [
            b
            for b in bags
            if b["size"] * gpu_capacity * (1 + 1e-12) >= seq["workload"]
            and b["size"] <= seq["length"]
        ]
        if not candidates:
            candidates = [b for b in bags if b["size"] == largest]
        best = min(
            candidates,
            key=lambda b: (b["load"] / b["capacity"] if b["capacity"] > 0 else b["load"], b["id"]),
        )
        best["load"] += seq["workload"]
        seq["bag"] = best["id"]
        g = best["size"]
        seq["remainder_chunk"] = best["round_robin"] % g
        if seq["length"] % g:
            best["round_robin"] += 1

    chunks = []
    for sid in sorted(seqs):
        seq = seqs[sid]
        bag = bags[seq["bag"]]
        g, length = bag["size"], seq["length"]
        offset = 0
        for k, gpu in enumerate(bag["gpus"]):
            chunk_len = length // g + (length % g if k == seq["remainder_chunk"] else 0)
            if chunk_len == 0:
                continue
            chunks.append(
                {
                    "seq": sid,
                    "src_gpu": seq["src_gpu"],
                    "dst_gpu": gpu,
                    "offset": offset,
                    "length": chunk_len,
                }
            )
            offset += chunk_len
    return {"sequences": seqs, "chunks": chunks, "bags": [b["gpus"] for b in bags]}
