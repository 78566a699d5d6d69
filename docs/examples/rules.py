"""Print the numbers behind a rule of the toolkit, read from the code that applies it, so
that a page quoting them cannot disagree with the code.

Run: ``python docs/examples/rules.py {stragglers,history,views}`` (docs/debugging.md,
docs/concepts.md and docs/dashboard.md show its output).
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table


def straggler_rules() -> Table:
    from knapformer.diagnosis.stragglers import THRESHOLDS, WINDOW

    table = _table("the verdicts of knapformer stragglers (knapformer/diagnosis/stragglers.py)")
    table.add_row("WINDOW", f"{WINDOW}", "measured steps analysed by default: the most recent")
    table.add_row(
        "slow_ratio", f"{THRESHOLDS.slow_ratio:g}", "compute ratio from which a step is slow"
    )
    table.add_row(
        "heavy_load",
        f"{THRESHOLDS.heavy_load:g}",
        "predicted load (1.00 = ideal) from which a step is overloaded by the plan",
    )
    table.add_row(
        "persistence",
        f"{THRESHOLDS.persistence:.0%}",
        "of a rank's measured steps that must agree, median included",
    )
    table.add_row(
        "min_steps", f"{THRESHOLDS.min_steps}", "measured steps before any verdict but ok"
    )
    table.add_row(
        "min_steps_gpu",
        f"{THRESHOLDS.min_steps_gpu}",
        "measured steps before slow_gpu (the rate's line needs them)",
    )
    table.add_row(
        "link_bandwidth",
        f"{THRESHOLDS.link_bandwidth:g}",
        "link probe: fastest link over the group's at or below which a probe is slow",
    )
    table.add_row(
        "min_probes", f"{THRESHOLDS.min_probes}", "link probes before a rank can be slow_link"
    )
    return table


def history_rules() -> Table:
    from knapformer.planning.history import LAG_STEPS, SPEED_BOUNDS, WARMUP_STEPS, WINDOW_STEPS

    low, high = SPEED_BOUNDS
    table = _table("the history cost model (knapformer/planning/history.py)")
    table.add_row("WARMUP_STEPS", f"{WARMUP_STEPS}", "measured steps before speeds are used")
    table.add_row("WINDOW_STEPS", f"{WINDOW_STEPS}", "per-step speeds a speed is the median of")
    table.add_row("SPEED_BOUNDS", f"{low:g} .. {high:g}", "no GPU is taken for slower or faster")
    table.add_row("LAG_STEPS", f"{LAG_STEPS}", "the plan of step s learns from steps up to s - lag")
    table.add_row("rounding", "2 significant digits", "the same number in JSON and on every rank")
    return table


def view_rules() -> Table:
    from knapformer.dashboard.app import PAGE_SIZE, TICK_MS
    from knapformer.visualization import axes
    from knapformer.visualization.straggler_figures import (
        HEATMAP_PLOT_PX,
        LABEL_EVERY_RANK_UP_TO,
        RATIO_OCTAVES,
    )

    from knapformer.diagnosis.stragglers import WINDOW

    table = _table("the dashboard's views (visualization/axes.py, straggler_figures.py)")
    label = f"{axes.CHAR_PX:g} px a character + {axes.PAD_PX:g} px at {axes.FONT_PX} px"
    table.add_row("label room", label, f"on a plot {axes.PLOT_PX:,} px wide, horizontal")
    for gpus in (8, 32, 64, 128):
        widest = len(str(gpus - 1)) * axes.CHAR_PX + axes.PAD_PX
        k = axes.stride(gpus, widest, axes.PLOT_PX)
        table.add_row(f"{gpus} GPUs", _every(k), "rank labels along a per-GPU axis")
    table.add_row("MAX_VIEW_GPUS", f"{axes.MAX_VIEW_GPUS}", "more GPUs: groups of whole bags")
    table.add_row("MAX_BOUNDARIES", f"{axes.MAX_BOUNDARIES}", "more bags: lines where sizes change")
    for ranks in (8, 32, 1024):
        k = axes.stride(ranks, axes.LINE_PX, HEATMAP_PLOT_PX)
        table.add_row(f"{ranks:,} ranks", _every(k), "rank labels down a heatmap")
    table.add_row("ratio colours", f"{2**-RATIO_OCTAVES:g} .. {2**RATIO_OCTAVES:g}", "blue .. red")
    table.add_row(
        "LABEL_EVERY_RANK_UP_TO", f"{LABEL_EVERY_RANK_UP_TO}", "more ranks: named ranks labelled"
    )
    table.add_row("straggler window", f"{WINDOW}", "measured steps the straggler views show")
    table.add_row("PAGE_SIZE", f"{PAGE_SIZE}", "rows of the sequence table per page")
    table.add_row("TICK_MS", f"{TICK_MS}", "ms between the page's looks for new steps")
    return table


def _every(k: int) -> str:
    return "every one" if k == 1 else "every 2nd" if k == 2 else f"every {k}th"


def _table(title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for name in ("rule", "value", "what it is"):
        table.add_column(name, justify="right" if name == "value" else "left")
    return table


RULES = {"stragglers": straggler_rules, "history": history_rules, "views": view_rules}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rules", choices=RULES)
    Console(highlight=False).print(RULES[parser.parse_args().rules]())


if __name__ == "__main__":
    main()
