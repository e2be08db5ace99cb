"""Error types. Every user mistake raises a subclass of :class:`MoendError` so the CLI can print one line."""


class MoendError(ValueError):
    """A user-facing error: bad input, a file that does not parse, a plan for another model."""


class PlanError(MoendError):
    """A routing plan, layer config or grid is invalid."""


class BudgetError(MoendError):
    """A memory budget does not parse or cannot be met."""


class TableError(MoendError):
    """A sensitivity table file is missing, truncated, tampered with or for another model."""
