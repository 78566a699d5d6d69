"""The inline styles of the dashboard's layout: cards, rows of figures and notices."""

from __future__ import annotations

HIDDEN = {"display": "none"}
SHOWN = {"display": "block"}
CARD = {
    "padding": "8px 14px",
    "border": "1px solid #dee2e6",
    "borderRadius": "6px",
    "minWidth": "150px",
}
PICKER = {"display": "flex", "alignItems": "center", "margin": "6px 0"}
#: A figure beside another, wrapping onto the next line on a narrow window.
HALF = {"flex": "1", "minWidth": "420px"}
NOTICE = {
    "padding": "8px 12px",
    "margin": "8px 0",
    "background": "#fff4e6",
    "border": "1px solid #ffa94d",
    "borderRadius": "6px",
    "whiteSpace": "pre-wrap",
}
#: The banner of a run's incident (a rank that failed).
INCIDENT = {
    "padding": "8px 12px",
    "margin": "8px 0",
    "background": "#fff5f5",
    "border": "1px solid #e03131",
    "color": "#c92a2a",
    "borderRadius": "6px",
    "fontWeight": "bold",
    "whiteSpace": "pre-wrap",
}
#: The figure of a graph before its first figure comes: no axes. Plotly lays out and
#: measures the made-up axes of a graph without one (-1..6, ticks and all), which for
#: the dozen graphs of the page delayed the first whole-run views by ~0.3 s.
WAITING = {"data": [], "layout": {"xaxis": {"visible": False}, "yaxis": {"visible": False}}}
