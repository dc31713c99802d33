"""Rank layouts: plan which worker writes which slot, and check a live region's slots."""
