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
