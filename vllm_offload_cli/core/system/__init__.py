"""The one layer that reads the host: /proc, /sys, mountinfo, cgroups and libc.

Everything else in the package asks this layer and never opens a path under
/proc or /sys itself (tests/test_architecture.py enforces it). One parser per
file format, one error policy: a process that vanished or denies access is a
value (`GONE`, `DENIED`, or None where the difference does not matter), never
an exception that escapes.

psutil answers what it answers well: the pids, a process's name,
environment and CPU affinity, the mount table and available memory. The rest
is read by hand because psutil has no reader for it (or reads more than is
needed): a process's identity and state from one read of /proc/PID/stat,
its uids and capability masks from one read of /proc/PID/status, mappings
and descriptors matched by (device, inode), /proc/locks, smaps/numa_maps per
mapping, PID namespaces, cgroup memory limits, sysfs NUMA topology, and the
system calls of libc.py.
"""
