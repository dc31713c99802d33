"""Foundations that read nothing of the host: errors, exit statuses, problems, units, text
for untrusted strings, deadlines and bounded waits, extras and lazy torch, the pause hook."""
