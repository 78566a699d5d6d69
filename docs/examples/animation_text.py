"""Print the text an animation of a plan shows, and how it thins its labels, without rendering.

Run: ``python docs/examples/animation_text.py PLANS [--step N]`` (docs/animation.md shows its
output). The layout is a pure function of the plan (`visualization.layout.layout_plan`), so
this is exactly what ``knapformer animate`` would draw.
"""

import argparse

from knapformer.visualization.layout import layout_plan

from knapformer.contract.plan_io import read_plans, select_step

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("plans", help="a plan file")
parser.add_argument("--step", type=int, default=None, help="default: the last plan")
args = parser.parse_args()

plan = select_step(read_plans(args.plans), args.step).plan
layout = layout_plan(plan)
labelled = sum(1 for row in layout.rows if row.label)
print(f"title:   {layout.title}")
print(f"figures: {layout.stats_text}")
print(f"legend:  {layout.legend_text}")
print(f"footer:  {layout.note or '(none: nothing grouped, every GPU labelled)'}")
print(
    f"labels:  {labelled} of {len(layout.rows)} GPU rows labelled (every {layout.label_every}), "
    f"font size {layout.label_font:g}"
)
