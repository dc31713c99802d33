"""Looking at a host from outside: /proc scans for holders, page residency, region discovery."""
