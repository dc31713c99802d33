"""Development tooling: generated docs, not part of the installed package."""
