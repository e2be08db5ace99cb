"""Benchmarks behind ``moend bench``: decode speed and memory (:mod:`.decode`; its settings in
:mod:`.decode_settings`, one method's run in :mod:`.decode_run`, memory probes in :mod:`.probes`, its report in
:mod:`.decode_report`), and the suite that runs every benchmark and regenerates ``docs/results.md``
(:mod:`.suite`, :mod:`.report`)."""
