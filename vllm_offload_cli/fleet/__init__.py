"""Run a node-local command on every node of a Ray cluster (`ray_runner`, the only
module that imports ray) and merge the answers (`result`)."""
