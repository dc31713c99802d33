"""The one layer that reads the host: /proc, /sys, cgroups and libc (docs/architecture.md,
"Why one system layer"): one parser per format; a vanished or refusing process is a value."""
