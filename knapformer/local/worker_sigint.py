"""Imported by the workers' fork server only (`knapformer.local.launcher` preloads it;
nothing else imports it): every worker then starts with Ctrl-C ignored.

A terminal's Ctrl-C reaches the whole process group, workers included, and the parent
decides when workers stop. A worker ignores SIGINT from the first line of its target, but
one still bootstrapping would die of a KeyboardInterrupt with a traceback on the shared
stderr. The fork server hands each child the SIGINT disposition it had itself before it
started serving, so setting it here, at preload time, closes that window.
"""

import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
