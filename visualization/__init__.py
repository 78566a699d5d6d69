"""Readers that draw routing plans: plotly figures (for the dashboard and the static
report), and the manim animation with its plain layout."""
