"""The core library: regions, discovery, gc, layout checks and copy workers.

Subpackages import only those listed before them (tests/test_architecture.py):
`base`, `system` (the one layer that reads the host), `region`, `host`, then `layout`,
`reclaim` and `transfer` (which needs no `host`). None imports click or rich, and only
the modules that build tensor views or move bytes import torch (lazily), so `inspect`
and `garbage-collect` start without it.
"""
