"""Which tokens a layer keeps.

Takes post-RoPE keys/values (and, for query-reading scorers, a window of recent queries, or calibrated pre-RoPE
query statistics); gives a score per token (``scorers/``, one scorer per file), the kept indices (``selection``:
sinks and the recent window always kept) and the policy of when and how far a cache layer evicts (``policy``)."""
