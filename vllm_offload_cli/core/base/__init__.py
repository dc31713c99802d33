"""Foundations that read nothing of the host: errors, statuses, units, text, deadlines, extras."""
