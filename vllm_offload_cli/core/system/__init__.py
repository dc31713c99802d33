"""The one layer that reads the host: /proc, /sys, mountinfo, cgroups and libc.

Everything else in the package asks this layer and never opens a path under
/proc or /sys itself (tests/test_architecture.py enforces it). One parser per
file format, one error policy: a process that vanished or denies access is a
value (`GONE`, `DENIED`, or None where the difference does not matter), never
an exception that escapes.

psutil answers what it answers well: a process's identity (pid + start
time), state, owner uids, name, environment and CPU affinity, the boot time
and available memory. The rest is read by hand because psutil has no reader
for it: mappings and descriptors matched by (device, inode), /proc/locks,
smaps/numa_maps per mapping, mountinfo options, PID namespaces, capability
masks, cgroup memory limits, sysfs NUMA topology, and the system calls of
libc.py.
"""
