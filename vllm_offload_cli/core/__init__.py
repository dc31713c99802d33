"""The core library: regions, discovery, safety checks and copy workers.

Subpackages, each importing only those listed before it (tests/test_architecture.py
enforces this): `base`, `region`, `host`, then `layout`, `reclaim` and `transfer`.

Nothing under this package imports typer or rich, and only the modules that
build tensor views or move bytes import torch (lazily), so `inspect` and
`garbage-collect` start without it.
"""
