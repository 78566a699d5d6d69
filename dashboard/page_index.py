"""The dashboard page's HTML: Dash's own, plus two downloads started as the page is read.

Dash fetches the page's layout only once its scripts have run, and plotly.js (1.5 MB,
or 4.8 MB without its cartesian bundle: `plotly_bundle`) only once a graph is first
rendered. Preloading both lets the server answer and the
browser download while those scripts run, instead of after them: on a cold first visit
the plotly.js download alone was several tenths of a second of the time to the first
drawn figure. The preloads are the same requests Dash makes later (same URL, same
credentials mode: ``anonymous`` is a same-origin ``fetch``'s), so each is made once.
"""

from __future__ import annotations

#: Where Dash's renderer loads plotly.js from when it serves its files itself.
PLOTLY_PATH = "_dash-component-suites/plotly/package_data/plotly.min.js"
LAYOUT_PATH = "_dash-layout"

_INDEX = """<!DOCTYPE html>
<html>
    <head>
        {%metas%}
        <title>{%title%}</title>
        <link rel="preload" href="PREFIX_LAYOUT" as="fetch" crossorigin="anonymous">
        <link rel="preload" href="PREFIX_PLOTLY" as="script">
        {%favicon%}
        {%css%}
    </head>
    <body>
        {%app_entry%}
        <footer>
            {%config%}
            {%scripts%}
            {%renderer%}
        </footer>
    </body>
</html>"""


def index_string(prefix: str) -> str:
    """The page of a Dash app served under ``prefix`` (its ``requests_pathname_prefix``)."""
    return _INDEX.replace("PREFIX_LAYOUT", prefix + LAYOUT_PATH).replace(
        "PREFIX_PLOTLY", prefix + PLOTLY_PATH
    )
