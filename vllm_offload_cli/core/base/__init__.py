"""Foundations every package may use, reading nothing of the host: errors and exit
statuses, problems, units, text for untrusted strings, deadlines and bounded waits,
optional extras, lazy torch, the crash tests' pause hook."""
