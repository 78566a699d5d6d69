"""Live web dashboard of routing plans (Dash): `dashboard.server.start_server` / `serve`."""
