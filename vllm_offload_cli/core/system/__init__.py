"""The one layer that reads the host: /proc, /sys, mountinfo, cgroups and libc.

Nothing else opens a path under /proc or /sys (tests/test_architecture.py).
One parser per format; a process that vanished or denies access is a value
(`GONE`, `DENIED` or None), never an escaping exception. psutil answers what it
has a reader for; the rest (matching by device and inode, locks, smaps) is here.
"""
