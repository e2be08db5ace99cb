"""The long-context evaluation and the proxy validation.

``config`` (what a run measures), ``methods`` (the compared caches and their plans), ``steps`` (prefill and greedy
decode), ``runner`` (examples x methods x budgets -> records), ``continuation`` (teacher-forced KL), ``summary``,
``report_markdown`` and ``report`` (rows, tables, plot, files), ``stats`` (confidence intervals), ``proxy`` and
``proxy_report`` (predicted loss vs end-to-end KL); the tasks are in ``tasks``."""
