"""The check, once per balancer, that every rank constructed it with the same options.

Ranks that disagree on an option would otherwise find out in the worst way: a different
``gamma`` or solver makes different plans, whose all-to-alls gloo aborts on ("Received
data size doesn't match"); a different topology creates different sub-groups and the
constructor hangs; a different ``max_tokens_per_gpu`` fails on one rank only.
`agree_on_options` runs one all-gather over the parent process group, before any
sub-group is made, of a digest per option and whether the rank's own checks of its
options failed; on a difference it gathers the values (only then, so the message can
show them) and every rank raises the same `KnapformerError`. The same all-gather carries a
random number from each rank: the first rank's names the balancer in the process group's
store (`knapformer.runtime.roll_call`), the same on every rank and new in every run.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from knapformer.contract.topology import Topology
from knapformer.errors import KnapformerError
from knapformer.planning.communication import CommModel
from knapformer.runtime.balancer_config import BalancerConfig, PlannerOptions
from knapformer.runtime.groups import BalanceLayout
from knapformer.runtime.router import Group, name_ranks


def agree_on_config(
    topology: Topology | str | BalancerConfig,
    given: dict[str, Any],
    defaults: Mapping[str, Any],
    group: Group,
    ranks: Sequence[int],
    rank: int,
    device: torch.device,
) -> tuple[BalancerConfig, PlannerOptions, BalanceLayout, int]:
    """The balancer's config (``topology`` itself, or made from the option keywords
    ``given``), resolved on the group's global ``ranks``, once every rank agrees
    (`agree_on_options`); and the random number the ranks share. A mistake on this rank
    is raised only then, so that every rank fails alike."""
    config = problem = options = layout = None
    try:
        config = _config(topology, given, defaults)
        options, layout = config.resolve(tuple(ranks), rank)
    except KnapformerError as err:
        problem = err
    flat = config.flat() if config is not None else {"topology": topology, **given}
    shared = {name: _shown(v) for name, v in flat.items() if name not in ("run", "time_gc")}
    shared["process_group ranks"] = list(ranks)
    uid = agree_on_options(shared, problem, group, ranks, device)
    return config, options, layout, uid


def _config(
    topology: Topology | str | BalancerConfig, given: dict[str, Any], defaults: Mapping
) -> BalancerConfig:
    """``topology`` itself when it is a config (``given`` must then hold defaults only),
    or one made from the flat keywords ``given``."""
    if not isinstance(topology, BalancerConfig):
        return BalancerConfig.from_options(topology, **given)
    changed = [name for name, value in given.items() if not _same(value, defaults[name])]
    if changed:
        raise KnapformerError(
            f"pass the options in the BalancerConfig or as keywords, not both (got "
            f"{', '.join(changed)} besides a BalancerConfig)"
        )
    return topology


def _same(value: Any, default: Any) -> bool:
    if isinstance(default, tuple):
        return tuple(value) == default
    return value is default or value == default


def _shown(value: Any) -> Any:
    """An option as ranks compare it: a topology in its canonical form, sequences as
    lists (a tuple and a list of the same values agree)."""
    if isinstance(value, Topology):
        return str(value)
    if isinstance(value, CommModel):
        return value.as_options()
    if isinstance(value, str):
        try:
            return str(Topology.parse(value)) if value.startswith("g") else value
        except KnapformerError:
            return value
    if isinstance(value, list | tuple):
        return [_shown(v) for v in value]
    if isinstance(value, torch.Tensor | np.ndarray):
        return value.tolist()
    return value


def agree_on_options(
    options: Mapping[str, object],
    problem: KnapformerError | None,
    group: Group,
    ranks: Sequence[int],
    device: torch.device,
) -> int:
    """Collective over ``group`` (global ``ranks`` in group order): raise on every rank
    when a rank's own check of its options failed (``problem``: that rank raises it, the
    others name the rank) or when ranks passed different ``options`` (every rank: the
    same message naming each option that differs, its values and their ranks). Returns a
    random 56-bit number, the same on every rank."""
    names = list(options)
    nonce = secrets.randbits(56)
    mine = [0 if problem is None else 1, nonce, *(_digest(options[name]) for name in names)]
    sent = torch.tensor(mine, dtype=torch.int64, device=device)
    got = [torch.empty_like(sent) for _ in ranks]
    dist.all_gather(got, sent, group=group)
    table = torch.stack(got).cpu().tolist()
    failed = [rank for rank, row in zip(ranks, table, strict=True) if row[0]]
    if problem is not None:
        raise problem
    if failed:
        raise KnapformerError(
            f"SequenceBalancer options are invalid on {name_ranks(failed)} (its own error "
            "says why); no rank made the balancer"
        )
    differ = [i for i, name in enumerate(names) if len({row[2 + i] for row in table}) > 1]
    if not differ:
        return int(table[0][1])
    # Only now the values themselves, so that every rank can print them.
    shown = [repr(options[names[i]]) for i in differ]
    values: list[list[str] | None] = [None] * len(ranks)
    dist.all_gather_object(values, shown, group=group)
    parts = []
    for k, i in enumerate(differ):
        by_value: dict[str, list[int]] = {}
        for rank, theirs in zip(ranks, values, strict=True):
            by_value.setdefault(theirs[k], []).append(rank)
        said = "; ".join(f"{value} on {name_ranks(who)}" for value, who in by_value.items())
        parts.append(f"{names[i]} ({said})")
    raise KnapformerError(
        f"SequenceBalancer options differ across ranks: {', '.join(parts)}; every rank must "
        "construct the balancer with the same options"
    )


def _digest(value: object) -> int:
    """A digest of ``value``'s repr that fits int64 and is the same in every process."""
    data = hashlib.blake2b(repr(value).encode(), digest_size=7).digest()
    return int.from_bytes(data, "little")
