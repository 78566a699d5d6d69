"""Local worker processes on this machine: the one launcher that starts them, the live
demo that trains on them, and its toy model. Nothing in the core imports this package."""
