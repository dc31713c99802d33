"""The core library: regions, discovery, safety checks and copy workers.

Nothing under this package imports typer or rich, and only the modules that
build tensor views or move bytes import torch (lazily), so `inspect` and
`garbage-collect` start without it.
"""
