"""GPUs along a figure axis: bag order, bag bands, and which labels fit.

Every per-GPU figure lays its GPUs out bag by bag (slot ``i`` of the axis holds
``ranks[i]``), so a bag is one contiguous *band*. Labels are horizontal and never
overlap at the nominal plot size (`PLOT_PX` wide; the dashboard's plots are wider),
by one rule for every label (`fits`): a text of c characters needs ``c * CHAR_PX +
PAD_PX`` pixels at `FONT_PX`, and is drawn only where that much room is left.

- GPU ranks: every k-th slot, k the smallest power of two that leaves each label its
  room (`stride`). Every rank is labelled up to 64 GPUs; a 1,024-GPU axis labels every
  32nd. Flagged ranks (a straggler verdict) are labelled at any count: the stride's
  labels beside them give way (`rank_ticks`).
- Bags (`bag_text`): each band is labelled ``bag 3 · 4 GPUs`` when that fits, else
  ``bag 3``, else ``3``, else not at all (its bars still say it on hover). Above the
  bands, each run of consecutive bags of one size whose labels do not all say their size
  is named once ("8 bags × 1 GPU"), so the size of narrow bags stays readable.
- Bag boundaries (`boundaries`): drawn between every two bags up to `MAX_BOUNDARIES`
  bags, beyond that only where the bag size changes.
- Beyond `MAX_VIEW_GPUS` GPUs a per-GPU view shows groups instead (`gpu_groups`): whole
  bags, or runs of consecutive bags, at most `MAX_VIEW_GPUS` of them, and says so in its
  title (a 10,000-GPU heatmap would be 10⁸ cells, and bars thinner than a pixel show
  nothing). Their labels thin out by the same rule as ranks (`thinned_ticks`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from knapformer.contract.plan import RoutingPlan
from knapformer.contract.positions import gpu_positions

PLOT_PX = 1100  # nominal plot width the rule plans for (px)
FONT_PX = 12
CHAR_PX = 6.6  # an average character at FONT_PX (0.55 em)
PAD_PX = 3.0
LINE_PX = 16.0  # height one line of labels needs
MAX_BOUNDARIES = 64
#: Per-GPU views of a plan with more GPUs than this show groups of whole bags instead.
MAX_VIEW_GPUS = 128


@dataclass(frozen=True)
class GpuAxis:
    """Slots of an axis in bag order; arrays are indexed by slot unless named per bag."""

    ranks: np.ndarray  # (n,) GPU rank at each slot
    position: np.ndarray  # (n,) that GPU's index in plan.gpus
    bag: np.ndarray  # (n,) bag id at each slot
    bag_start: np.ndarray  # (num_bags,) first slot of each bag
    bag_size: np.ndarray  # (num_bags,)

    @property
    def slot_of_position(self) -> np.ndarray:
        """(n,) the slot of each GPU of plan.gpus."""
        slots = np.empty(len(self.position), dtype=np.int64)
        slots[self.position] = np.arange(len(self.position))
        return slots


@dataclass(frozen=True)
class GpuGroups:
    """Columns of a per-GPU view of a plan too large to draw GPU by GPU: whole bags, or
    runs of consecutive bags, so a group never splits a bag."""

    of_position: np.ndarray  # (num_gpus,) group of each GPU position of plan.gpus
    labels: list[str]  # (num_groups,) unique axis labels
    sizes: np.ndarray  # (num_groups,) GPUs per group
    note: str  # what the view shows instead of single GPUs
    short: list[str]  # (num_groups,) the bag ids of each group, for tick labels


def gpu_groups(plan: RoutingPlan) -> GpuGroups | None:
    """How per-GPU views aggregate ``plan``; None when it is small enough to show per GPU."""
    num_gpus, num_bags = len(plan.gpus), len(plan.bags)
    if num_gpus <= MAX_VIEW_GPUS:
        return None
    per = math.ceil(num_bags / MAX_VIEW_GPUS)
    of_bag = np.arange(num_bags) // per
    count = int(of_bag[-1]) + 1
    if per == 1:
        labels = [plan.bag_label(b) for b in range(num_bags)]
        short = [str(b) for b in range(num_bags)]
        note = f"aggregated by bag: {num_gpus:,} GPUs in {num_bags:,} bags"
    else:
        short = [f"{i * per}–{min((i + 1) * per, num_bags) - 1}" for i in range(count)]
        labels = [f"bags {text}" for text in short]
        note = f"aggregated: {num_gpus:,} GPUs in {count:,} runs of {per} bags"
    of_position = of_bag[plan.stats.gpu_bag]
    sizes = np.bincount(of_position, minlength=count)
    return GpuGroups(of_position, labels, sizes, note, short)


def gpu_axis(plan: RoutingPlan) -> GpuAxis:
    sizes = np.fromiter(map(len, plan.bags), dtype=np.int64, count=len(plan.bags))
    ranks = np.fromiter((g for m in plan.bags for g in m), dtype=np.int64, count=int(sizes.sum()))
    return GpuAxis(
        ranks=ranks,
        position=gpu_positions(plan.gpus)[ranks],
        bag=np.repeat(np.arange(len(sizes)), sizes),
        bag_start=np.cumsum(sizes) - sizes,
        bag_size=sizes,
    )


def fits(text: str, room_px: float) -> bool:
    """Whether ``text`` drawn horizontally at `FONT_PX` fits in ``room_px``."""
    return len(text) * CHAR_PX + PAD_PX <= room_px


def stride(count: int, label_px: float, length_px: float) -> int:
    """Label every k-th of ``count`` slots along ``length_px``: the smallest power of two
    k with k slots at least ``label_px`` long (1 when every slot has room)."""
    if count <= 0:
        return 1
    k = 1
    while k * length_px / count < label_px and k < count:
        k *= 2
    return k


def thinned_ticks(
    texts: list[str],
    length_px: float = PLOT_PX,
    vertical: bool = False,
    categories: list[str] | None = None,
    always: Iterable[int] = (),
) -> dict:
    """Axis ticks naming each slot by ``texts`` by the rule above: ``tickvals``,
    ``ticktext`` and the font. Along a vertical axis a label needs a line's height. On a
    category axis the ticks sit at the slots' ``categories``.

    The slots of ``always`` (e.g. flagged ranks) are labelled whatever the stride; the
    stride's labels too close to one of them make room for it."""
    widest = max(map(len, texts), default=1)
    need = LINE_PX if vertical else widest * CHAR_PX + PAD_PX
    shown = set(range(0, len(texts), stride(len(texts), need, length_px)))
    kept = sorted({i for i in always if 0 <= i < len(texts)})
    if kept:
        slot_px = length_px / max(len(texts), 1)
        near = max(math.ceil(need / slot_px) - 1, 0)  # slots a label would overlap
        shown = {i for i in shown if all(abs(i - k) > near for k in kept)} | set(kept)
    order = sorted(shown)
    return {
        "tickmode": "array",
        "tickvals": [categories[i] for i in order] if categories else order,
        "ticktext": [texts[i] for i in order],
        "tickangle": 0,
        "tickfont": {"size": FONT_PX},
    }


def rank_ticks(
    ranks: np.ndarray,
    length_px: float = PLOT_PX,
    vertical: bool = False,
    categories: list[str] | None = None,
    flagged: Iterable[int] = (),
) -> dict:
    """`thinned_ticks` naming each slot by its GPU rank; the ``flagged`` ranks are always
    labelled, at any GPU count."""
    ranks = np.asarray(ranks)
    always = np.flatnonzero(np.isin(ranks, np.fromiter(flagged, dtype=np.int64))).tolist()
    return thinned_ticks([str(r) for r in ranks.tolist()], length_px, vertical, categories, always)


def bag_text(plan: RoutingPlan, bag_id: int, room_px: float) -> str:
    """The longest of ``bag 3 · 4 GPUs``, ``bag 3``, ``3`` that fits in ``room_px`` ("" if
    none does)."""
    for text in (plan.bag_label(bag_id), f"bag {bag_id}", str(bag_id)):
        if fits(text, room_px):
            return text
    return ""


def size_runs(axis: GpuAxis) -> list[tuple[int, int]]:
    """Runs of consecutive bags of one size, as (first bag, bag count)."""
    runs: list[tuple[int, int]] = []
    for b, size in enumerate(axis.bag_size.tolist()):
        if runs and axis.bag_size[runs[-1][0]] == size:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def run_text(count: int, size: int, room_px: float) -> str:
    """How a run of ``count`` bags of ``size`` GPUs is named, by the same rule."""
    gpus = f"{size} GPU{'s' if size != 1 else ''}"
    full = f"{count} bags × {gpus}" if count > 1 else f"1 bag × {gpus}"
    for text in (full, f"{count}×{size}", str(size)):
        if fits(text, room_px):
            return text
    return ""


def boundaries(axis: GpuAxis) -> list[float]:
    """Axis positions (between slots) where one bag ends and the next begins."""
    starts = axis.bag_start[1:]
    if len(starts) >= MAX_BOUNDARIES:
        changed = axis.bag_size[1:] != axis.bag_size[:-1]
        starts = starts[changed]
    return (starts - 0.5).tolist()


def bag_bands(plan: RoutingPlan, axis: GpuAxis, length_px: float = PLOT_PX) -> dict:
    """Layout ``shapes`` and ``annotations`` drawing each bag as a shaded band along the x
    axis, labelled by the rule above, with its size run named above it."""
    n = len(axis.ranks)
    slot_px = length_px / max(n, 1)
    shapes, notes = [], []
    full = np.zeros(len(axis.bag_size), dtype=bool)  # bags whose label names their size
    starts, sizes = axis.bag_start.tolist(), axis.bag_size.tolist()
    for b, (start, size) in enumerate(zip(starts, sizes, strict=True)):
        shapes.append(
            {
                "type": "rect",
                "xref": "x",
                "yref": "paper",
                "x0": start - 0.5,
                "x1": start + size - 0.5,
                "y0": 0,
                "y1": 1,
                "fillcolor": "#f1f3f5" if b % 2 == 0 else "#ffffff",
                "line": {"width": 0},
                "layer": "below",
            }
        )
        text = bag_text(plan, b, size * slot_px)
        full[b] = text == plan.bag_label(b)
        if text:
            notes.append(_band_note(text, start + (size - 1) / 2, 1.0, f"bag {b}"))
    for first, count in size_runs(axis):
        start = int(axis.bag_start[first])
        size = int(axis.bag_size[first])
        width = count * size
        text = run_text(count, size, width * slot_px)
        if text and not full[first : first + count].all():
            notes.append(_band_note(text, start + (width - 1) / 2, 1.0, "size", shift=LINE_PX))
        if first > 0:
            shapes.append(_boundary(start - 0.5, "x", strong=True))
    return {"shapes": shapes, "annotations": notes}


def _band_note(text: str, x: float, y: float, name: str, shift: float = 0.0) -> dict:
    return {
        "text": text,
        "name": name,
        "x": x,
        "y": y,
        "xref": "x",
        "yref": "paper",
        "yanchor": "bottom",
        "yshift": shift,
        "showarrow": False,
        "font": {"size": FONT_PX, "color": "#495057"},
    }


def _boundary(at: float, axis: str, strong: bool = False) -> dict:
    """A line across the plot at ``at`` on ``axis`` ("x": vertical line, "y": horizontal)."""
    line = {"color": "#495057" if strong else "#adb5bd", "width": 1.5 if strong else 1}
    if axis == "x":
        return {"type": "line", "xref": "x", "yref": "paper", "x0": at, "x1": at,
                "y0": 0, "y1": 1, "line": line}  # fmt: skip
    return {"type": "line", "xref": "paper", "yref": "y", "x0": 0, "x1": 1,
            "y0": at, "y1": at, "line": line}  # fmt: skip


def boundary_lines(axis: GpuAxis) -> list[dict]:
    """Bag boundaries as lines across both axes of a GPU × GPU matrix in bag order."""
    lines = []
    for at in boundaries(axis):
        lines += [_boundary(at, "x"), _boundary(at, "y")]
    return lines


def bag_lines(axis: GpuAxis) -> list[dict]:
    """Bag boundaries as vertical lines across a per-GPU chart in bag order."""
    return [_boundary(at, "x") for at in boundaries(axis)]


#: Room left around the data on an axis fitted to it, as a share of the data's span.
DATA_PAD = 0.08


def data_range(values: np.ndarray) -> list[float] | None:
    """[low, high] of an axis that starts where the data does: the values' span with a
    little room (`DATA_PAD`), never below 0 for values that are not; None (plotly's
    autorange) without a finite value."""
    finite = np.asarray(values, dtype=np.float64)
    finite = finite[np.isfinite(finite)]
    if not finite.size:
        return None
    low, high = float(finite.min()), float(finite.max())
    pad = DATA_PAD * ((high - low) or max(abs(high), 1.0))
    bottom = low - pad
    return [max(bottom, 0.0) if low >= 0 else bottom, high + pad]
