"""Run a node-local command on every node of a Ray cluster and merge the answers.

`result` merges per-node envelopes into one answer and one exit code, `render`
shows it; neither needs Ray. `ray_runner` is the only module that imports ray,
and only when a fleet command runs.
"""
