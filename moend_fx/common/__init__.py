"""Shared by every stage: errors, atomic file writes, defaults, argument checks and option enums.

Takes nothing from the other stages; every other stage may import it."""
