"""The routing plan and the one memory model.

Takes a grid of per-layer configs (keep_ratio, K bits, V bits) and a model fingerprint; gives the frozen,
versioned, JSON-serialised :class:`~moend_fx.plan.routing.RoutingPlan` (one config per layer) and
``moend_fx.plan.memory``: the exact byte count of what the cache stores for a layer, and budgets ("14x",
"136MB") resolved against a 16-bit cache. Solvers, the cache and every report price bytes here.

Modules, in dependency order: ``config`` (:class:`LayerConfig`), ``grid`` (:class:`Grid`), ``fingerprint``
(:class:`ModelFingerprint`), ``memory`` (bytes and budgets; reads a plan through a protocol, never imports it),
``routing`` (:class:`RoutingPlan` and its JSON; re-exports the three above) and ``summary`` (one-line plan
descriptions)."""
