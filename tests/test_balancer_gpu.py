"""The CUDA path: NCCL, world size 1, CUDA tensors (skipped without CUDA).

The round-trip and recorder tests also run on gloo with CPU tensors, so that the same
test code is exercised on every machine; their NCCL cases are marked ``gpu``.
"""

from __future__ import annotations

import math

import pytest
import torch

from knapformer.testing.dist_helpers import run_world_backend

GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
BACKENDS = [pytest.param("nccl", marks=GPU), "gloo"]


def _device(backend: str) -> torch.device:
    """The device a balancer on ``backend`` routes on (CUDA with NCCL)."""
    if backend == "nccl":
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


class _HostSyncs:
    """Records a CUDA operation that makes the host wait for the GPU, instead of doing it
    (CUDA's sync debug mode set to "error", process-wide); does nothing on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.errors: list[str] = []

    def __enter__(self) -> None:
        if self.cuda:
            torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, kind, err, tb) -> bool:
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
        if kind is RuntimeError and "synchroniz" in str(err):
            self.errors.append(str(err))
            return True
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_nccl_world1(tmp_path):
    (res,) = run_world_backend(_worker, 1, tmp_path, "nccl")
    assert res["device"].startswith("cuda") and res["y_device"].startswith("cuda")
    assert res["identity"]
    assert res["chunk_lens"] == [7, 130, 1, 64]  # the zero-length sequence has no chunk
    assert res["model_close"] and res["grads"]
    assert res["timings"] == ["gather", "plan", "reverse_route", "route"]


def _worker(rank: int, world: int) -> dict:
    from knapformer.local.models import ToyDiT
    from knapformer.runtime.balancer import SequenceBalancer

    torch.cuda.set_device(rank)
    bal = SequenceBalancer("g1n1")
    lens = [0, 7, 130, 1, 64]
    bal.plan_routing(lens, token_dim=64)
    x = torch.randn(sum(lens), 64, device="cuda")
    ids = torch.arange(sum(lens), device="cuda", dtype=torch.int64) + (1 << 60)
    chunk_lens, y, f = bal.route(x, {"ids": ids})
    _, back, fb = bal.reverse_route(y, f)
    torch.manual_seed(0)
    model = ToyDiT(64, 4, 2).cuda()
    out = model(x, lens, balancer=bal)
    out.sum().backward()
    ref = model(x, lens)
    return {
        "device": str(bal.device),
        "y_device": str(y.device),
        "identity": torch.equal(back, x) and torch.equal(fb["ids"], ids),
        "chunk_lens": chunk_lens,
        "model_close": torch.allclose(out, ref, atol=1e-5),
        "grads": all(
            p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters()
        ),
        "timings": sorted(bal.timings),
    }


# ------------------------------------------------------------------- round trip
LENS = [0, 5, 300, 1, 0, 77]
DIM, HEADS = 32, 4


def _round_trip_worker(rank: int, world: int, backend: str) -> dict:
    """route -> pre_attn -> post_attn -> reverse_route -> backward, no host sync allowed."""
    from knapformer.runtime.balancer import SequenceBalancer

    device = _device(backend)
    bal = SequenceBalancer("g1n1")
    bal.plan_routing(LENS, token_dim=DIM)
    rows = sum(LENS)
    q, k, v = (torch.randn(rows, DIM, device=device, requires_grad=True) for _ in range(3))
    sent = {
        "q": q,
        "k": k,
        "v": v,
        "half": torch.randn(rows, DIM, device=device).to(torch.bfloat16),
        "ids": torch.arange(rows, device=device, dtype=torch.int64) + (1 << 60),
    }
    weights = {n: torch.randn(rows, DIM, device=device) for n in "qkv"}
    syncs = _HostSyncs(device)
    with syncs:
        chunk_lens, q1, f = bal.route(q, {n: sent[n] for n in ("k", "v", "half", "ids")})
        split = (-1, HEADS, DIM // HEADS)
        seq_lens, q2, k2, v2 = bal.pre_attn(
            q1.reshape(split), f["k"].reshape(split), f["v"].reshape(split)
        )
        _, out = bal.post_attn(v2)  # "attention" = v: post_attn must give v back
        features = {"q": q2.reshape(-1, DIM), "k": k2.reshape(-1, DIM)}
        features |= {"half": f["half"], "ids": f["ids"]}
        home_lens, back_v, back = bal.reverse_route(out.reshape(-1, DIM), features)
        loss = sum((back[n] * weights[n]).sum() for n in "qk")
        (loss + (back_v * weights["v"]).sum()).backward()
    if syncs.errors:
        return {"sync_errors": syncs.errors}
    routed = {"q": q1, **f}
    returned = {"v": back_v, **back}
    return {
        "sync_errors": [],
        "devices": sorted({str(t.device) for t in (*routed.values(), *returned.values())}),
        "chunk_lens": chunk_lens,
        "seq_lens": seq_lens,
        "home_lens": home_lens,
        "sent": {n: t.detach().cpu() for n, t in sent.items()},
        "routed": {n: t.detach().cpu() for n, t in routed.items()},
        "attn_in": [t.detach().cpu() for t in (q2, k2, v2)],
        "returned": {n: t.detach().cpu() for n, t in returned.items()},
        "grads": {n: sent[n].grad.cpu() for n in "qkv"},
        "weights": {n: w.cpu() for n, w in weights.items()},
        "timings": sorted(bal.timings),
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_round_trip_is_bit_exact_with_autograd_and_never_syncs(tmp_path, backend):
    (res,) = run_world_backend(_round_trip_worker, 1, tmp_path, backend, backend)
    assert res["sync_errors"] == []  # route ... backward never made the host wait
    assert res["devices"] == (["cuda:0"] if backend == "nccl" else ["cpu"])
    non_empty = [n for n in LENS if n]
    assert res["chunk_lens"] == non_empty and res["seq_lens"] == non_empty
    assert res["home_lens"] == LENS
    sent = res["sent"]
    for name in sent:  # one GPU: every row stays in place, ids above 2**53 included
        assert torch.equal(res["routed"][name], sent[name]), name
        assert torch.equal(res["returned"][name], sent[name]), name
    for got, name in zip(res["attn_in"], "qkv", strict=True):
        assert torch.equal(got, sent[name].reshape(-1, HEADS, DIM // HEADS))
    for name in "qkv":  # the reverse all-to-alls carry the gradients back unchanged
        assert torch.equal(res["grads"][name], res["weights"][name])
    assert res["timings"] == ["gather", "plan", "reverse_route", "route"]


# --------------------------------------------------------------------- recorder
STEPS = 4


def _recorder_worker(rank: int, world: int, backend: str, path: str) -> dict:
    """Steps whose phases the balancer times (CUDA events on a GPU, read at the next
    plan) and records; the steps between two plans may not wait for the GPU."""
    from knapformer.runtime.balancer import SequenceBalancer
    from knapformer.runtime.recorder import PlanRecorder

    device = _device(backend)
    weight = torch.randn(DIM, DIM, device=device)
    bal = SequenceBalancer("g1n1", recorder=PlanRecorder(path))
    syncs = _HostSyncs(device)
    for step in range(STEPS):
        lens = [100 + 50 * step, 0, 400]
        bal.plan_routing(lens, token_dim=DIM)  # gathers lengths: may wait for the GPU
        x = torch.randn(sum(lens), DIM, device=device)
        with syncs:
            _, y, _ = bal.route(x)
            qkv = (y @ weight).reshape(-1, HEADS, DIM // HEADS)
            _, q, k, v = bal.pre_attn(qkv, qkv, qkv)
            _, out = bal.post_attn(q + k + v)
            bal.reverse_route(out.reshape(-1, DIM))
    bal.finish()
    bal.close()
    return {"sync_errors": syncs.errors, "device": str(bal.device)}


@pytest.mark.parametrize("backend", BACKENDS)
def test_phases_are_recorded_without_syncing_the_steps(tmp_path, backend):
    from knapformer.contract.plan_io import read_plans

    path = tmp_path / "plans.jsonl"
    (res,) = run_world_backend(_recorder_worker, 1, tmp_path, backend, backend, str(path))
    assert res["device"].startswith("cuda" if backend == "nccl" else "cpu")
    assert res["sync_errors"] == []
    plans = read_plans(path, on_error="raise").plans
    assert [p.step for p in plans] == list(range(STEPS))
    for plan in plans:
        times = plan.measurements.per_rank_ms
        for phase in ("plan", "route", "reverse_route"):
            (ms,) = times[phase]
            assert math.isfinite(ms) and ms > 0, (plan.step, phase, ms)
        assert "pre_attn" not in times  # a 1-GPU bag re-shards nothing
    # a step's whole time is known when the next one starts, the last one's at finish()
    assert ["step" in p.measurements.per_rank_ms for p in plans] == [True] * STEPS
