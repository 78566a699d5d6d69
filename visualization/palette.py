"""The colours of a plan's views: the dashboard's plotly figures, the HTML report and the
animation draw the same quantity in the same colour.

Each colour that a legend names in words has its name next to it (``CAPACITY_NAME``), so
a legend never says "yellow" about a green line. Sequence colours are not here: they
are generated per sequence id (`visualization.layout.sequence_color`).
"""

from __future__ import annotations

#: Per-GPU load before balancing.
BEFORE = "#b0b7c3"
#: Per-GPU load after balancing.
AFTER = "#2a6fdb"
#: The capacity line: the mean GPU's load, what a perfect balance reaches.
CAPACITY = "#2f9e44"
CAPACITY_NAME = "green"
#: A fitted or ideal model line (predicted = measured).
MODEL_FIT = "#2f9e44"
#: Measured points.
MEASURED = "#1c7ed6"
#: The workload model's two parts: linear layers and attention.
LINEAR_PART = "#868e96"
ATTENTION_PART = "#e8590c"
#: A selected sequence, the selected step, stragglers.
HIGHLIGHT = "#e8590c"
#: Items too small to draw one by one, drawn as one block per GPU.
GROUPED = "#7d838c"
GROUPED_NAME = "grey"
#: The moved-token fraction, the planning time and the measured step time on the timeline.
MOVED = "#7048e8"
PLAN_TIME = "#868e96"
STEP_TIME = "#c2255c"
#: Straggler views: a rank the plan overloads (a slow GPU is drawn in HIGHLIGHT), and the
#: compute-ratio scale from faster than predicted through as predicted to slower.
DATA_IMBALANCE = "#f08c00"
FASTER = "#1c7ed6"
AS_PREDICTED = "#f8f9fa"
SLOWER = "#e03131"
#: Verdicts beyond slow GPU and data imbalance (`knapformer.diagnosis.stragglers`).
SLOW_HOST = "#9c36b5"
SLOW_INPUT = "#5f3dc4"
SLOW_LINK = "#c2255c"
LAYOUT_FLOOR = "#495057"
#: The animation's background (a dark slide), and its text.
ANIMATION_BACKGROUND = "#101318"
ANIMATION_TEXT = "#e9ecef"
ANIMATION_MUTED_TEXT = "#adb5bd"
#: Where a step's time goes (the per-rank phase stacks, a step's loss): one clearly
#: distinct hue per group of phases, at most eight, shades within a group (darkest
#: first). Time waiting in a collective is drawn hatched (`WAITING_PATTERN`) in the hue of
#: the collective's group, its transfer solid.
PHASE_GROUPS = {
    "compute": ("#1864ab", "#4dabf7", "#a5d8ff"),  # the model's compute, the optimizer
    "plan": ("#8d5524", "#d4a373"),  # what the plan leaves: layout floor, solver gap
    "host": ("#6741d9", "#9775fa", "#d0bfff"),  # host work, waiting for data
    "exchanges": ("#d9480f", "#ff922b", "#ffc078"),  # route, Ulysses, reverse route
    "sync": ("#087f5b", "#38d9a9", "#96f2d7"),  # the length gather, the gradient all-reduce
    "probe": ("#f59f00",),  # the link probe (a diagnostic)
    "cpu": ("#495057", "#adb5bd", "#dee2e6"),  # waiting for a core, between phases, other
}
WAITING_PATTERN = "/"
#: The tokens-per-GPU cap line.
CAP = "#c92a2a"
