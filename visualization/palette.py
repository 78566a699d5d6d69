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
#: The per-rank phase breakdown: compute parts in blues (the model's compute is AFTER),
#: the transfer inside collectives in grey, and waiting, one warm colour per collective
#: (in `knapformer.contract.phases.COLLECTIVE_PHASES` order).
HOST_WORK = "#91a7ff"
DATA_WAIT = "#d0bfff"
DESCHEDULED = "#c5f6fa"  # on the CPU: the thread ready to compute, waiting for a core
TRANSFER = "#adb5bd"
WAITING = ("#ffd43b", "#f08c00", "#e8590c", "#c92a2a", "#a61e4d", "#862e9c", "#5f3dc4")
#: The tokens-per-GPU cap line.
CAP = "#c92a2a"
