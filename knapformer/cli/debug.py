"""``knapformer replay``, ``simulate``, ``suggest`` and ``calibrate``: reproduce a recorded
plan locally and ask "what if" of the balancer offline."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from knapformer.cli.bounds import bounded
from knapformer.cli.errors import UserError
from knapformer.cli.extras import require
from knapformer.cli.plans import PLAN_ARGUMENT
from knapformer.cli.progress import progress
from knapformer.contract.output_file import output_file
from knapformer.contract.phases import COMPUTE_PHASES
from knapformer.contract.runfiles import PLANS_FILE
from knapformer.contract.stats import before_after
from knapformer.errors import KnapformerError


def register(app: typer.Typer) -> None:
    app.command()(replay)
    app.command()(simulate)
    app.command()(suggest)
    app.command()(calibrate)


def _run_files(out: object) -> str:
    """Where `simulate --out` writes each run (a run is named <topology>-<solver>)."""
    return str(Path(str(out)) / "<topology>-<solver>" / PLANS_FILE)


def _console() -> Console:
    return Console(highlight=False, width=max(Console().width, 150))


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


# ---------------------------------------------------------------------- replay
def replay(
    file: Path = typer.Argument(..., metavar="PLAN", help=PLAN_ARGUMENT),
    step: int | None = typer.Option(
        None, callback=bounded, help="step to replay (default: the last plan)"
    ),
    dim: int | None = typer.Option(
        None, callback=bounded, help="hidden size of the synthetic tokens (default 8/head)"
    ),
    heads: int | None = typer.Option(
        None,
        callback=bounded,
        help="attention heads; a multiple of every bag size (default: smallest >= 4)",
    ),
) -> None:
    """Re-execute a recorded plan on one local CPU process per GPU (gloo) and check it.

    Re-plans from the recorded lengths (must give the recorded plan), then runs route →
    pre_attn → post_attn → reverse_route on tokens carrying their ids. Exit 1 on any
    mismatch, naming the first difference.
    """
    from knapformer.cli.plans import read_step
    from knapformer.contract.phases import BALANCER_PHASES
    from knapformer.tools.replay import check_options
    from knapformer.tools.replay import replay as run_replay

    plan = read_step(file, step)[0].plan
    dim, heads = check_options(plan, dim, heads)  # refuse bad options before announcing
    console = _console()
    console.print(
        f"replaying {file}{'' if plan.step is None else f' step {plan.step}'}: "
        f"{plan.topology}, {len(plan.gpus)} GPUs, {len(plan.sequences)} sequences, "
        f"{len(plan.chunks)} chunks, solver {plan.solver} "
        f"on {len(plan.gpus)} local processes (gloo)"
    )
    try:
        out = run_replay(plan, dim=dim, heads=heads)
    except RuntimeError as err:
        raise UserError(f"replay failed: {err}") from err

    table = Table(
        title=f"per rank · synthetic tokens of dim {out.dim}, {out.heads} heads · tokens = "
        "route, bytes = route + Ulysses + reverse_route · times in ms",
        title_justify="left",
    )
    for name in ("GPU", "tokens out", "tokens in", "bytes out", "bytes in"):
        table.add_column(name, justify="right")
    phases = [p for p in BALANCER_PHASES if any(p in r.timings_ms for r in out.ranks)]
    for p in phases:
        table.add_column(p, justify="right")
    table.add_column("check")
    for r in out.ranks:
        table.add_row(
            str(plan.gpus[r.rank]),
            f"{r.tokens_sent:,}",
            f"{r.tokens_received:,}",
            _bytes(r.bytes_sent),
            _bytes(r.bytes_received),
            *(f"{r.timings_ms.get(p, 0.0):.1f}" for p in phases),
            "ok" if r.error is None else "[red]MISMATCH[/red]",
        )
    console.print(table)
    if out.replanned:
        planning = (
            "re-planned from the recorded lengths: identical plan"
            if out.plan_difference is None
            else "[red]re-planned from the recorded lengths: DIFFERENT[/red] — "
            + (f"{out.planner_changed}; " if out.planner_changed else "")
            + out.plan_difference
        )
    else:
        planning = (
            f"[yellow]planning not re-checked[/yellow]: {out.skip_reason}; "
            "the recorded routing itself was replayed"
        )
    console.print(planning)
    errors = out.routing_errors
    console.print(
        "routing: every token reached its chunk's GPU and came back to where it started"
        if not errors
        else f"[red]routing: {len(errors)} rank(s) mismatched[/red] — first: {errors[0]}"
    )
    if out.ok:
        console.print("[green]verdict: OK[/green]")
        return
    console.print(f"[red]verdict: MISMATCH[/red] — {out.first_problem}")
    raise typer.Exit(1)


# -------------------------------------------------------------------- simulate
def _comm_options(cluster: str, intra_gbs, inter_gbs, node_size, tflops, layers, dtype_bytes):
    """The `CommModel` of the cluster options (a cluster class's figures, overridden)."""
    from knapformer.planning.communication import CommModel

    given = {"intra_gbs": intra_gbs, "inter_gbs": inter_gbs, "node_size": node_size,
             "tflops": tflops, "layers": layers, "dtype_bytes": dtype_bytes}  # fmt: skip
    return CommModel.cluster(cluster, **{k: v for k, v in given.items() if v is not None})


def _comm_line(comm) -> str:
    return (
        f"{comm.intra_gbs:g} GB/s in a node of {comm.node_size}, {comm.inter_gbs:g} GB/s across · "
        f"{comm.tflops:g} TFLOP/s · {comm.layers} layers"
    )


_CLUSTER_HELP = "nominal link figures: nvlink, infiniband or pcie (planning/communication.py)"


def simulate(
    data_codes: str = typer.Option(
        ..., "--data-codes", help="mix name (lowres, mixres, joint) or codes gGbBiIfFsS,..."
    ),
    topology: list[str] = typer.Option(
        ...,
        "--topology",
        "-t",
        help="topology to try: --topology g8n4 g4n8 auto, or repeat the flag (auto: each "
        "step's own partition, groups inside nodes of --node-size GPUs)",
    ),
    more: list[str] | None = typer.Argument(
        None, metavar="TOPOLOGY", help="more topologies (after --topology T)"
    ),
    steps: int = typer.Option(10, callback=bounded, help="sampled steps"),
    d_model: int = typer.Option(3072, "--d-model", callback=bounded, help="token dimension d"),
    gamma: float = typer.Option(
        0.4, callback=bounded, help="attention weight γ of the workload model"
    ),
    solver: list[str] = typer.Option(
        ["knapformer", "greedy"], "--solver", help="solver(s) to compare"
    ),
    dtype_bytes: int = typer.Option(
        2, "--dtype-bytes", callback=bounded, help="bytes per value (bf16 = 2)"
    ),
    cluster: str = typer.Option("nvlink", help=_CLUSTER_HELP),
    node_size: int = typer.Option(8, "--node-size", callback=bounded, help="GPUs per node"),
    seed: int = typer.Option(0, callback=bounded, help="random seed of the data sampler"),
    out: Path | None = typer.Option(
        None,
        help=f"folder to record the plans in: {_run_files('OUT')} per run "
        "(view with: knapformer dashboard OUT)",
    ),
) -> None:
    """Simulate a data mix over steps, topologies and solvers (what-if, no GPUs).

    Prints per topology and solver the modelled step time (makespan) without and with
    balancing, speedup, imbalance, the modelled milliseconds of a step (the slowest GPU's
    compute + communication, at --cluster's figures), moved tokens and bytes, and max
    tokens per GPU.
    """
    from knapformer.contract.plan_io import write_jsonl
    from knapformer.planning.datamix import parse_mix
    from knapformer.tools.simulate import check_options, run_files, run_name
    from knapformer.tools.simulate import simulate as run_simulate

    codes = parse_mix(data_codes)
    topologies = [t for arg in [*topology, *(more or [])] for t in arg.replace(",", " ").split()]
    comm = _comm_options(cluster, None, None, node_size, None, None, None)
    # Everything that can be wrong is checked before simulating, the --out folder included.
    topos = check_options(codes, topologies, steps, solver, dtype_bytes, seed, comm)
    files = None
    if out is not None:
        files = run_files(out, list(dict.fromkeys(run_name(t, s) for t in topos for s in solver)))
    plans: dict[str, list] = {run: [] for run in files or {}}
    console = _console()
    with progress("simulating", "steps", Console(stderr=True)) as on_progress:
        result = run_simulate(
            codes,
            topologies,
            steps=steps,
            token_dim=d_model,
            gamma=gamma,
            solvers=solver,
            seed=seed,
            dtype_bytes=dtype_bytes,
            on_plan=(lambda plan: plans[plan.run].append(plan)) if files else None,
            on_step=lambda i: on_progress(i + 1, steps),
            comm=comm,
        )
    table = Table(
        title=f"{data_codes} on {result.num_gpus} GPUs · {steps} steps · d={d_model} γ={gamma} "
        f"· {cluster}: {_comm_line(comm)} · means per step",
        title_justify="left",
    )
    for name in (
        "topology", "solver", "step time", "speedup", "imbalance", "moved tokens", "comm",
        "max tok/GPU", "plan ms",
    ):  # fmt: skip
        table.add_column(
            name, justify="left" if name in ("topology", "solver") else "right", no_wrap=True
        )
    for s in result.summaries:
        table.add_row(
            s.topology,
            s.solver,
            before_after(s.mean_makespan_before, s.mean_makespan_after, ".4g"),
            f"{s.speedup:.2f}×",
            f"{before_after(s.mean_imbalance_before, s.mean_imbalance_after)} "
            f"(max {s.worst_imbalance_after:.3f})",
            f"{s.mean_moved_tokens:,.0f} ({s.moved_fraction:.0%})",
            _bytes(s.comm_bytes),
            f"{s.max_tokens_per_gpu:,}",
            f"{s.mean_plan_ms:.2f}",
        )
    console.print(table)
    console.print(
        "step time = makespan (workload units) unbalanced → balanced; imbalance = max/mean "
        "load; comm = route + reverse_route bytes per step over all GPUs "
        f"(moved tokens × 2 × d × {dtype_bytes} B); max tokens/GPU is the peak after routing "
        f"(before: {max(s.max_tokens_per_gpu_before for s in result.summaries):,})"
    )
    console.print(_modelled_table(result, f"{cluster}: {_comm_line(comm)}"))
    if files:
        count = 0
        for run, path in files.items():
            path.parent.mkdir(exist_ok=True)
            count += write_jsonl(path, plans[run])
        # soft_wrap: paths and the command stay whole, to copy and paste.
        console.print(
            f"wrote {count} plans in {len(files)} runs to {_run_files(out)}",
            soft_wrap=True,
        )
        console.print(f"view them with: knapformer dashboard {out}", soft_wrap=True)


def _modelled_table(result, figures: str) -> Table:
    """The modelled step of every topology and solver, compute and communication apart,
    with the partitions auto chose."""
    from collections import Counter

    table = Table(
        title=f"modelled step, ms (the slowest GPU, all layers) · {figures}", title_justify="left"
    )
    for name in ("topology", "solver", "step", "compute", "comm", "partitions"):
        table.add_column(name, justify="right" if name in ("step", "compute", "comm") else "left")
    for s in result.summaries:
        used = Counter(s.partitions).most_common()
        table.add_row(
            s.topology,
            s.solver,
            f"{s.mean_step_ms:.1f}",
            f"{s.mean_compute_ms:.1f}",
            f"{s.mean_comm_ms:.1f}",
            ", ".join(f"{t} ×{n}" for t, n in used) if len(used) > 1 or s.topology != used[0][0]
            else "fixed",
        )  # fmt: skip
    return table


# --------------------------------------------------------------------- suggest
def suggest(
    data_codes: str = typer.Option(
        ..., "--data-codes", help="mix name (lowres, mixres, joint) or codes gGbBiIfFsS,..."
    ),
    gpus: int = typer.Option(..., "--gpus", callback=bounded, help="GPUs of one balance group"),
    max_bag: int = typer.Option(
        8, "--max-bag", callback=bounded, help="largest bag size (a power of two)"
    ),
    steps: int = typer.Option(4, callback=bounded, help="sampled steps per topology"),
    d_model: int = typer.Option(3072, "--d-model", callback=bounded, help="token dimension d"),
    gamma: float = typer.Option(0.4, callback=bounded, help="attention weight γ"),
    cluster: str = typer.Option("nvlink", help=_CLUSTER_HELP),
    intra_gbs: float | None = typer.Option(
        None,
        "--intra-gbs",
        callback=bounded,
        help="GB/s per GPU inside a node (default: the cluster's)",
    ),
    inter_gbs: float | None = typer.Option(
        None,
        "--inter-gbs",
        callback=bounded,
        help="GB/s per GPU across nodes (default: the cluster's)",
    ),
    node_size: int = typer.Option(8, "--node-size", callback=bounded, help="GPUs per node"),
    tflops: float = typer.Option(
        400.0, "--tflops", callback=bounded, help="achieved TFLOP/s per GPU"
    ),
    layers: int = typer.Option(57, callback=bounded, help="transformer layers"),
    dtype_bytes: int = typer.Option(
        2, "--dtype-bytes", callback=bounded, help="bytes per value (bf16 = 2)"
    ),
    auto: bool = typer.Option(
        True, "--auto/--no-auto", help="rank topology auto (each step's own partition) too"
    ),
    top: int = typer.Option(10, callback=bounded, help="rows to print"),
    seed: int = typer.Option(0, callback=bounded, help="random seed of the data sampler"),
) -> None:
    """Rank the topologies of N GPUs, and auto, for a data mix by modelled step time.

    Step time = compute at --tflops + Ulysses exchanges inside bags and routing over the
    node link (--intra-gbs) or the network (--inter-gbs), so bigger bags are not free
    (model: knapformer/planning/communication.py).
    """
    from knapformer.planning.datamix import parse_mix
    from knapformer.tools.suggest import auto_sizes, check_options, enumerate_topologies, fit_mix
    from knapformer.tools.suggest import suggest as run_suggest

    check_options(gpus, max_bag, steps, seed)
    if top < 1:
        raise KnapformerError(f"--top must be at least 1 (rows to print), got {top}")
    comm = _comm_options(cluster, intra_gbs, inter_gbs, node_size, tflops, layers, dtype_bytes)
    codes = fit_mix(parse_mix(data_codes), gpus)
    candidates = enumerate_topologies(gpus, max_bag)
    console = _console()
    with progress("simulating", "topologies", Console(stderr=True)) as on_progress:
        ranked = run_suggest(
            codes, gpus, max_bag, steps, gamma, comm, seed=seed, topologies=candidates,
            on_topology=on_progress, token_dim=d_model, auto=auto,
        )  # fmt: skip
    best = ranked[0]
    table = Table(
        title=f"{data_codes} on {gpus} GPUs: {len(ranked)} topologies (bags ≤ {max_bag}), "
        f"{steps} steps · {cluster}: {_comm_line(comm)} · d={d_model}",
        title_justify="left",
    )
    for name in ("#", "topology", "step ms", "compute", "Ulysses", "routing", "speedup", "why"):
        table.add_column(name, justify="left" if name in ("topology", "why") else "right")
    shown = ranked[:top]
    # Always listed: the single-GPU baseline and auto.
    for always in (
        next((s for s in ranked if not s.auto and s.max_bag_size == 1), None),
        next((s for s in ranked if s.auto), None),
    ):
        if always is not None and always not in shown:
            shown = [*shown, always]
    for s in sorted(shown, key=ranked.index):
        table.add_row(
            str(ranked.index(s) + 1),
            s.name,
            f"{s.step_ms:.1f}",
            f"{s.compute_ms:.1f}",
            f"{s.ulysses_ms:.1f}",
            f"{s.routing_ms:.1f}",
            f"{s.speedup:.2f}×",
            s.reasons(best),
        )
    console.print(table)
    if auto and auto_sizes(gpus, max_bag, comm) is None:
        console.print(f"auto not ranked: {gpus} GPUs do not cut into nodes of {node_size}")
    console.print(
        f"suggested: [bold]{best.name}[/bold] — modelled {best.step_ms:.1f} ms/step vs "
        f"{best.unbalanced_ms:.1f} ms unbalanced ({best.speedup:.2f}×). speedup = unbalanced "
        "step time / modelled step time; compute/Ulysses/routing are the slowest GPU's, all "
        "layers."
    )


# ------------------------------------------------------------------- calibrate
def calibrate(
    file: Path | None = typer.Argument(
        None,
        metavar="FILE",
        help="CSV with header length,latency (ms per sequence) or plans JSON/JSONL",
    ),
    token_dim: int | None = typer.Option(
        None,
        "--token-dim",
        callback=bounded,
        help="model hidden size d (default: the plans' token_dim; with --benchmark 3072)",
    ),
    benchmark: bool = typer.Option(
        False,
        "--benchmark",
        help="time a DiT block here (CUDA if available, else CPU) over --lengths and fit that",
    ),
    heads: int = typer.Option(
        24, callback=bounded, help="--benchmark: attention heads of the block"
    ),
    lengths: str = typer.Option(
        "256,512,1024,2048,4096,8192,16384,32768",
        help="--benchmark: comma-separated sequence lengths to time",
    ),
    device: str | None = typer.Option(None, help="--benchmark: cpu or cuda (default: cuda if any)"),
    tokens: int = typer.Option(32768, callback=bounded, help="--benchmark: tokens per timed batch"),
    phase: str | None = typer.Option(
        None,
        help="measured phase of the plans to fit (default: the first measured of "
        f"{', '.join(COMPUTE_PHASES)})",
    ),
    plot: Path | None = typer.Option(None, help="write predicted-vs-measured plotly HTML here"),
) -> None:
    """Fit the workload model's time scale k and γ from measured latencies (or, with
    --benchmark, from a DiT block timed here)."""
    from knapformer.tools.calibrate import calibrate_file

    if (file is None) == (not benchmark):
        raise UserError("give a measurements FILE or --benchmark (one of them)")
    if plot is not None:  # before the fit, so that a missing extra costs no wait
        require("dashboard", "knapformer calibrate --plot", "plotly")

    console = _console()
    if benchmark:
        from knapformer.tools.block_benchmark import run_benchmark

        bench = run_benchmark(token_dim, heads, lengths, device, tokens, console.print)
        cal, source = bench.calibration, bench.source
    else:
        cal = calibrate_file(file, token_dim, phase)
        source = (
            f"{len(cal.measured)} (length, latency) pairs"
            if cal.source == "csv"
            else f"{len(cal.measured)} per-GPU times of phase {cal.phase!r}"
        )
    for problem in cal.skipped:
        print(f"skipped {problem}", file=sys.stderr)
    console.print(f"fitted from {source}, d = {cal.model.token_dim}:")
    console.print(f"  k (ms per workload unit) = {cal.scale:.6g}")
    console.print(f"  γ (attention weight)     = {cal.gamma:.4g}")
    console.print(f"  predictions              = {cal.error_line}   R² = {cal.r2:.4f}")
    reason = cal.unusable_reason
    if reason is None:
        console.print(
            f"use: WorkloadModel(token_dim={cal.model.token_dim}, gamma={cal.gamma:.4g}, "
            f"scale={cal.scale:.6g}) predicts ms; the balancer only needs gamma={cal.gamma:.4g}"
        )
    else:
        console.print(f"[bold]not usable[/bold]: {reason}. Keep your γ; {cal.remedy}")
    if plot is not None:
        from knapformer.visualization.calibration import calibration_figure

        title = "DiT block benchmark" if file is None else str(file)
        with output_file(plot) as f:
            calibration_figure(cal, title=title).write_html(f, include_plotlyjs=True)
        console.print(f"wrote {plot}")
