"""Live web dashboard of routing plans (Dash): `knapformer.dashboard.server.start_server`
and `serve`."""
