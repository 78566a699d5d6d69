"""Balanced training forwards for models users already train (the ``integrations`` layer:
above the runtime, below the local launcher). ``knapformer.integrations.diffusers``
needs the ``[diffusers]`` extra."""
