"""Garbage collection: remove only provably stale regions, and report what was kept and why."""
