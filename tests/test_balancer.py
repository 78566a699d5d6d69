"""SequenceBalancer on real gloo process groups (spawned CPU processes).

One spawn per world size runs every check for several topologies; workers report
numbers and tensors back, and the assertions run here.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
import torch.distributed as dist

from knapformer.contract.phases import RECORDED_PHASES
from knapformer.testing.dist_helpers import run_world
from knapformer.testing.toy_world import D_MODEL, LAYERS, toy_data, toy_model, toy_reference

HEAVY = 600  # tokens of one sequence heavier than any bag's fair share


def _lengths(world: int, case: str) -> list[list[int]]:
    """Per-rank sequence lengths of a test case (same on every process)."""
    if case == "single":  # one sequence in the whole world
        return [[41] if r == 0 else [] for r in range(world)]
    rng = np.random.default_rng(world)
    out = [rng.integers(5, 40, size=rng.integers(1, 5)).tolist() for _ in range(world)]
    # zero-length, shorter than any multi-GPU bag, and one too heavy for any bag
    out[0] = [0, 1, 3, HEAVY, *out[0], 0]
    if world > 1:
        out[1] = []  # a rank with no sequences
    return out


def _local_rows(lengths: list[list[int]], rank: int) -> slice:
    start = sum(sum(x) for x in lengths[:rank])
    return slice(start, start + sum(lengths[rank]))


class _CountingDist:
    """Counts torch.distributed collectives and the bytes all-to-all sends to others."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.sent_bytes = 0
        self._orig = {}
        for name in (
            "all_to_all_single",
            "all_gather",
            "all_reduce",
            "broadcast",
            "all_to_all",
            "all_gather_into_tensor",
            "send",
            "recv",
        ):
            self._orig[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name, self._orig[name]))

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            if name == "all_to_all_single" and len(args) < 4:  # even splits: the row header
                self.calls["row_header"] += 1
                return fn(*args, **kwargs)
            self.calls[name] += 1
            if name == "all_to_all_single":
                _, inp, _, send_splits = args[:4]
                group = kwargs.get("group")
                me = dist.get_rank(group)
                row_bytes = inp[0].numel() * inp.element_size() if inp.shape[0] else 0
                self.sent_bytes += sum(s for j, s in enumerate(send_splits) if j != me) * row_bytes
            return fn(*args, **kwargs)

        return counted

    def take(self) -> tuple[dict[str, int], int]:
        calls, sent = dict(self.calls), self.sent_bytes
        self.calls.clear()
        self.sent_bytes = 0
        return calls, sent


def _check_step(bal, lengths, counter, rank) -> dict:
    """Route/reverse identity, bit-exact features, model outputs/grads, collective counts."""
    res: dict = {}
    mine = lengths[rank]
    counter.take()
    plan = bal.plan_routing(mine, token_dim=D_MODEL)
    res["plan_calls"], _ = counter.take()
    res["step"] = bal.step
    res["plan_ms"] = plan.measurements.plan_ms
    plan = plan.validated()  # the emitted plan satisfies every invariant

    # --- route -> reverse_route identity, features bit-exact
    x_all, _ = toy_data(lengths)
    x = x_all[_local_rows(lengths, rank)].float()
    seq_of_token = torch.repeat_interleave(
        torch.arange(len(mine)), torch.tensor(mine, dtype=torch.int64)
    )
    group_start = bal.group_ranks[0]  # sequence ids count from the balance group's start
    first_seq = sum(len(x) for x in lengths[group_start:rank])
    from knapformer.local.models import positions_in_sequences

    pos = positions_in_sequences(mine)
    # ids that a float cast would corrupt: > 2**24 and > 2**53 apart
    ids = ((seq_of_token + first_seq) << 40) + pos + (1 << 60)
    feats = {
        "ids": ids,
        "i32": (ids % 2_000_000_007).to(torch.int32) - 1_000_000_000,
        "bf16": x[:, :3].to(torch.bfloat16),
        "flag": (pos % 3 == 0),
    }
    chunk_lens, y, f = bal.route(x, feats)
    res["route_calls"], res["route_bytes"] = counter.take()
    res["row_bytes"] = D_MODEL * 4 + 8 + 4 + 3 * 2 + 1  # x, ids, i32, bf16, flag
    # every routed token carries exactly the id the plan says it should
    mine_chunks = np.flatnonzero(plan.chunks.dst_gpu == bal.rank)
    expect = [
        (int(plan.chunks.seq[c]) << 40)
        + (1 << 60)
        + int(plan.chunks.offset[c])
        + np.arange(int(plan.chunks.length[c]))
        for c in mine_chunks
    ]
    expect_ids = np.concatenate(expect) if expect else np.zeros(0, dtype=np.int64)
    res["routed_ids_ok"] = bool(np.array_equal(f["ids"].numpy(), expect_ids))
    res["chunk_lens_ok"] = chunk_lens == plan.chunks.length[mine_chunks].tolist()
    res["routed_dtypes"] = {k: str(v.dtype) for k, v in f.items()}
    seq_lens, x_back, f_back = bal.reverse_route(y, f)
    res["reverse_calls"], res["reverse_bytes"] = counter.take()
    res["identity"] = torch.equal(x_back, x) and all(
        torch.equal(f_back[k], feats[k]) for k in feats
    )
    res["reverse_lens_ok"] = seq_lens == list(mine)
    moved = (plan.chunks.src_gpu == bal.rank) & (plan.chunks.dst_gpu != bal.rank)
    res["moved_out"] = int(plan.chunks.length[moved].sum())
    moved_in = (plan.chunks.dst_gpu == bal.rank) & (plan.chunks.src_gpu != bal.rank)
    res["moved_in"] = int(plan.chunks.length[moved_in].sum())

    # --- autograd through route/reverse_route alone: d(sum(w*rr(r(x))))/dx = w
    xg = x.clone().requires_grad_(True)
    _, yg, _ = bal.route(xg)
    _, back, _ = bal.reverse_route(yg * 2.0)
    back.backward(torch.ones_like(back))
    res["route_grad_ok"] = torch.equal(xg.grad, torch.full_like(x, 2.0))
    counter.take()

    # --- reference model with the balancer
    model = toy_model()
    x_all, w_all = toy_data(lengths)
    rows = _local_rows(lengths, rank)
    out = model(x_all[rows], mine, balancer=bal)
    res["fwd_calls"], _ = counter.take()
    loss = (out * w_all[rows]).sum()
    loss.backward()
    res["bwd_calls"], _ = counter.take()
    res["out"] = out.detach()
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)  # each rank holds the gradient of its share of tokens
    counter.take()
    res["grad"] = flat
    res["multi_bag"] = bal.tables.bag is not None
    res["timings"] = dict(bal.timings)
    res["previous_timings"] = dict(bal.previous_timings)
    # Known figures that travel to every rank with the next step's lengths.
    bal.add_timing("optimizer", float(rank))
    bal.add_timing("forward_backward", 100.0)
    return res


def _errors(bal, world) -> dict[str, str]:
    """Bad inputs, every rank making the same mistake (so nobody waits in a collective)."""
    msgs: dict[str, str] = {}

    def catch(key, fn):
        try:
            fn()
        except (ValueError, RuntimeError, TypeError) as err:
            msgs[key] = f"{type(err).__name__}: {err}"

    catch("negative", lambda: bal.plan_routing([3, -2], token_dim=8))
    # One rank's mistake: every rank raises instead of its peers hanging in a collective.
    first = bal.group_ranks[0]
    catch("one_rank", lambda: bal.plan_routing([3, -2] if bal.rank == first else [4], 8))
    bal.plan_routing([5, 7], token_dim=8)
    catch("rows", lambda: bal.route(torch.zeros(11, 4)))
    catch("feature_rows", lambda: bal.route(torch.zeros(12, 4), {"pos": torch.zeros(3)}))
    n = bal.tables.num_chunk_tokens
    catch("qkv_rank", lambda: bal.pre_attn(*(torch.zeros(n, 16),) * 3))
    catch("heads", lambda: bal.pre_attn(*(torch.zeros(n, 3, 4),) * 3))
    catch("post_rank", lambda: bal.post_attn(torch.zeros(n, 16)))
    catch("reverse_rows", lambda: bal.reverse_route(torch.zeros(n + 1, 4)))
    from knapformer.runtime.balancer import SequenceBalancer

    catch("topology", lambda: SequenceBalancer("g1n3"))
    return msgs


def _timed_optimizer(topology: str) -> tuple[float, float]:
    """The optimizer phase of a step whose ``opt.step()`` a balancer's hooks timed, and
    of the step after the hooks were removed (0: not timed)."""
    from knapformer.runtime.balancer import SequenceBalancer

    bal = SequenceBalancer(topology)
    param = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([param], lr=0.1)
    handles = bal.time_optimizer(opt)
    bal.plan_routing([4], D_MODEL)
    param.grad = torch.ones(3)
    opt.step()
    bal.plan_routing([4], D_MODEL)  # ends the step whose opt.step() the hooks timed
    hooked = bal.previous_timings.get("optimizer", 0.0)
    for handle in handles:
        handle.remove()
    opt.step()
    bal.plan_routing([4], D_MODEL)  # ends a step without the hooks
    unhooked = bal.previous_timings.get("optimizer", 0.0)
    bal.close()
    return hooked, unhooked


def _worker(rank: int, world: int, topologies: list[str]) -> dict:
    from knapformer.runtime.balancer import SequenceBalancer

    counter = _CountingDist()
    results: dict = {}
    for topo in topologies:

        class Recorder:  # a sink, as a PlanRecorder is
            closed = 0
            steps: list[int] = []  # noqa: RUF012

            def record(self, plan):
                self.steps.append(plan.step)

            def close(self):
                Recorder.closed += 1

        bal = SequenceBalancer(topo, recorder=Recorder(), run="test")
        try:
            bal.route(torch.zeros(1, 1))
        except RuntimeError as err:
            results[(topo, "early")] = str(err)
        counter.take()
        per_case = {
            case: _check_step(bal, _lengths(world, case), counter, rank)
            for case in ("mixed", "single")
        }
        results[topo] = per_case
        measured = bal.last_gathered  # every rank's figures of the first step
        results[(topo, "rows")] = [
            [o, f]
            for o, f in zip(
                measured.column("optimizer").tolist(),
                measured.column("forward_backward").tolist(),
                strict=True,
            )
        ]
        results[(topo, "group")] = (bal.group_ranks, bal.my_bag)
        results[(topo, "optimizer")] = _timed_optimizer(topo)
        results[(topo, "errors")] = _errors(bal, world)
        own = list(bal.groups.owned())
        bal.close()
        bal.close()
        results[(topo, "recorder")] = (Recorder.steps, Recorder.closed)
        # close() destroyed the sub-groups this rank belongs to (and only them: the next
        # topology still balances over WORLD).
        alive = []
        for group in own:
            try:
                dist.get_process_group_ranks(group)
                alive.append(group)
            except KeyError:
                pass
        results[(topo, "destroyed")] = (len(own), len(alive))
        try:
            bal.plan_routing([1], D_MODEL)
        except RuntimeError as err:
            results[(topo, "after_close")] = str(err)
    return results


WORLDS = {
    1: ["g1n1"],
    2: ["g2n1", "g1n2"],
    4: ["g1n4", "g4n1", "g2n1"],  # g2n1 at world 4: two replicas of one 2-GPU bag
    8: ["g1n2+g2n1+g4n1", "g8n1", "g2n2"],  # g2n2 at world 8: two replicas
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "world", [pytest.param(w, marks=pytest.mark.slow) if w == 8 else w for w in sorted(WORLDS)]
)
def test_balancer_on_gloo(world, tmp_path):
    results = run_world(_worker, world, tmp_path, WORLDS[world])
    refs = {case: toy_reference(_lengths(world, case)) for case in ("mixed", "single")}
    for topo in WORLDS[world]:
        from knapformer.contract.topology import Topology

        t = Topology.parse(topo)
        if t.num_bags > 1:  # the edge case is really there (needs a choice of bags)
            from knapformer.planning.workload import WorkloadModel

            work = WorkloadModel(D_MODEL).workload(
                np.concatenate(_lengths(world, "mixed")[: t.num_gpus])
            )
            fair_share = work.sum() / t.num_gpus
            assert WorkloadModel(D_MODEL).workload(HEAVY) > t.max_bag_size * fair_share
        for rank, res in enumerate(results):  # time_optimizer: its hooks time opt.step()
            hooked, unhooked = res[(topo, "optimizer")]
            assert hooked > 0 and unhooked == 0, (topo, rank, hooked, unhooked)
        for case in ("mixed", "single"):
            lengths = _lengths(world, case)
            ref_out, ref_grad = refs[case]
            for rank, res in enumerate(results):
                r = res[topo][case]
                where = f"{topo} {case} rank {rank}"
                assert r["identity"], f"{where}: reverse_route(route(x)) != x"
                assert r["routed_ids_ok"], f"{where}: routed integer ids differ from the plan"
                assert r["chunk_lens_ok"] and r["reverse_lens_ok"], where
                assert r["routed_dtypes"] == {
                    "ids": "torch.int64",
                    "i32": "torch.int32",
                    "bf16": "torch.bfloat16",
                    "flag": "torch.bool",
                }, where
                assert r["route_grad_ok"], f"{where}: gradient through route/reverse_route"
                # outputs of this rank's rows and the all-reduced gradient match one process
                torch.testing.assert_close(
                    r["out"], ref_out[_local_rows(lengths, rank)], rtol=1e-9, atol=1e-10
                )
                torch.testing.assert_close(r["grad"], ref_grad, rtol=1e-9, atol=1e-10)
                # collectives: 2 small all-gathers to plan, one all-to-all per exchange,
                # after a tiny one of the row or head layout (knapformer.runtime.layouts)
                assert r["plan_calls"] == {"all_gather": 2}, where
                assert r["route_calls"] == {"all_to_all_single": 1, "row_header": 1}, where
                assert r["reverse_calls"] == {"all_to_all_single": 1, "row_header": 1}, where
                ulysses = 2 * LAYERS if r["multi_bag"] else 0
                assert r["multi_bag"] == (len(res[(topo, "group")][1]) > 1), where
                fwd = {"all_to_all_single": 2 + ulysses, "row_header": 2 + ulysses}
                assert r["fwd_calls"] == fwd, where
                # backward: reverse_route + every pre/post_attn (the input needs no grad)
                assert r["bwd_calls"] == {"all_to_all_single": 1 + ulysses}, where
                # bytes sent = moved tokens x bytes per token (incl. features)
                assert r["route_bytes"] == r["moved_out"] * r["row_bytes"], where
                assert r["reverse_bytes"] == r["moved_in"] * r["row_bytes"], where
                assert r["step"] == (0 if case == "mixed" else 1), where
                assert r["plan_ms"] > 0
                assert set(r["timings"]) == {
                    "plan",
                    "gather",
                    "record",
                    "route",
                    "reverse_route",
                } | ({"pre_attn", "post_attn"} if r["multi_bag"] else set()), where
                # The balancer times only phases named in the plan schema's one list.
                assert set(r["timings"]) | set(r["previous_timings"]) <= set(RECORDED_PHASES)
                if case == "single":
                    assert r["previous_timings"]["step"] > 0, where
                    assert r["previous_timings"]["route"] > 0, where
        moved = sum(res[topo]["mixed"]["moved_out"] for res in results)
        if world > 1:
            assert moved > 0, f"{topo}: the mixed case should move tokens"
        for rank, res in enumerate(results):
            group, bag = res[(topo, "group")]
            assert group == t.group_of(rank, world)
            assert rank in bag and len(bag) in t.bag_sizes
            # Every rank's recorder row of the previous step arrived with the lengths
            # (the plan's two all-gathers, checked above, are all it took).
            assert res[(topo, "rows")] == [[float(r), 100.0] for r in group], res[(topo, "rows")]
            recorded, closed = res[(topo, "recorder")]
            assert recorded == [0, 1, 2], "recorder.record once per plan, on every rank"
            assert closed == 1, "close() is idempotent"
            own, alive = res[(topo, "destroyed")]
            replicas = world // t.num_gpus
            # a bag that spans its balance group uses that group: no group of its own
            spans = len(bag) == t.num_gpus
            assert own == (replicas > 1) + (len(bag) > 1 and not spans), "balance and bags"
            assert alive == 0, f"{topo} rank {rank}: close() left {alive} sub-group(s) alive"
            assert "closed" in res[(topo, "after_close")]
            assert "plan_routing" in res[(topo, "early")]
            errs = res[(topo, "errors")]
            assert "negative length -2" in errs["negative"]
            first = res[(topo, "group")][0][0]
            if rank == first:
                assert "negative length -2" in errs["one_rank"], errs
            else:
                assert f"invalid local_seq_lens on rank {first} " in errs["one_rank"], errs
            assert "shape (11, 4)" in errs["rows"] and "12 tokens" in errs["rows"]
            assert "feature 'pos'" in errs["feature_rows"]
            assert "(tokens, heads, head_dim)" in errs["qkv_rank"]
            assert "(tokens, heads, head_dim)" in errs["post_rank"]
            assert "shape" in errs["reverse_rows"]
            if max(t.bag_sizes) > 1:
                assert "3 attention heads" in errs["heads"], errs
            else:
                assert "heads" not in errs
            assert "g1n3" in errs["topology"] and f"world size {world}" in errs["topology"]
