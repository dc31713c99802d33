"""Foundations every package may use: errors, problems, units, libc, /proc basics, lazy torch."""
