"""Shared by every stage: errors, atomic file writes, defaults, storage type rules, argument checks and option enums.

Takes nothing from the other stages; every other stage may import it."""
