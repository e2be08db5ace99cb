"""Which tokens a layer keeps.

Takes post-RoPE keys/values (and, for query-reading scorers, a window of recent queries, or calibrated pre-RoPE
query statistics); gives a score per token (``scorers/``, one scorer per file, and the factory the cache and
calibration share), the kept indices (``selection``: sinks and the recent window always kept), the policy of when
and how far a cache layer evicts (``policy``) and the object a cache layer evicts through (``evictor``: policy,
scorer, the scorer's query window (``query_window``) and the rows' RoPE offsets)."""
