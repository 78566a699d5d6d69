"""Print how many communicators a rank holds for each topology option.

They are counted by the code that creates them
(`knapformer.runtime.groups.BalanceLayout.communicators`), so that the page quoting the
counts cannot disagree with the code. No process group is needed.

Run: ``python docs/examples/communicators.py`` (docs/performance.md and
docs/integration.md show its output).
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from knapformer.contract.topology import Topology
from knapformer.planning.partitions import allowed_sizes
from knapformer.runtime.groups import BalanceLayout

NODE = 8  # GPUs per node: auto's groups stay inside a node by default
#: (option, GPUs of the job): fixed topologies on 32 GPUs, then auto as it grows.
OPTIONS = [
    ("g1n32", 32),
    ("g2n16", 32),
    ("g8n4", 32),
    ("g1n8+g2n4+g4n2+g8n1", 32),
    ("g8n1", 32),
    ("auto", 8),
    ("auto", 32),
    ("auto", 1024),
]


def layout(option: str, gpus: int) -> BalanceLayout:
    ranks = tuple(range(gpus))
    if option != "auto":
        return BalanceLayout(Topology.parse(option), ranks, 0)
    sizes, _ = allowed_sizes(gpus, NODE)
    return BalanceLayout(None, ranks, 0, group_sizes=sizes)


def table() -> Table:
    out = Table(
        title=f"NCCL communicators a rank holds beyond its job's group (the most any rank "
        f"holds; auto: nodes of {NODE} GPUs, default group sizes)"
    )
    cols = ("topology", "GPUs", "balance group", "bag groups", "reused")
    for col in (*cols, "communicators", "without reuse", "gloo twins"):
        out.add_column(col, justify="left" if col == "topology" else "right")
    for option, gpus in OPTIONS:
        lay = layout(option, gpus)
        # every replica alike: the ranks of the first one cover every case
        counts = [lay.communicators(r) for r in lay.replicas[0]]
        most = max(counts, key=lambda c: (c.total, c.reused))
        out.add_row(
            option, f"{gpus:,}", str(most.balance), str(most.bags), str(most.reused),
            str(most.total), str(most.without_reuse), str(most.host_twins),
        )  # fmt: skip
    return out


if __name__ == "__main__":
    Console(width=120).print(table())
