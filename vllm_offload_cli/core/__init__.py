"""The core library: regions, discovery, safety checks and copy workers.

Subpackages, each importing only those listed before it (tests/test_architecture.py
enforces this): `base`, `system` (the one layer that reads the host), `region`,
`host`, then `layout`, `reclaim` and `transfer` (which needs no `host`).

Nothing under this package imports click or rich, and only the modules that
build tensor views or move bytes import torch (lazily), so `inspect` and
`garbage-collect` start without it.
"""
