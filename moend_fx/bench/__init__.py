"""Benchmarks behind ``moend bench``: decode speed and memory (:mod:`.decode`), the suite that runs every
benchmark and regenerates ``docs/results.md`` (:mod:`.suite`, :mod:`.report`)."""
