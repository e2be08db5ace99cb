"""``moend bench kernels``' rows and table: each row read against the host's streaming read of the same run."""

import math

import pytest

from moend_fx.kernels import bench, cpu


def test_stream_read_is_a_positive_rate():
    assert 0 < bench.stream_read_gbs(2**20, runs=2) < math.inf


def test_rows_carry_the_hosts_streaming_read_and_their_share_of_it():
    rows = bench.bench_decode((256,), runs=2, bits=(4,), threads=(1,), stream_bytes=2**20)
    methods = {r["method"] for r in rows}
    assert {"sdpa_fp32", "reference_k4v4"} <= methods
    assert ("cpu_k4v4" in methods) == cpu.available()
    stream = {r["stream_gb_per_s"] for r in rows}
    assert len(stream) == 1 and stream.pop() > 0  # one measurement per thread count, shared by its rows
    for r in rows:
        assert r["gb_per_s"] == pytest.approx(r["bytes"] / (r["ms"] * 1e-3) / 1e9)
        assert r["of_stream"] == pytest.approx(r["gb_per_s"] / r["stream_gb_per_s"])
        assert r["x_vs_sdpa"] * r["ratio_vs_sdpa"] == pytest.approx(1.0)
    md = bench.to_markdown(rows)
    assert "This host's streaming read (torch.sum over 1 MB of fp32" in md and "GB/s at 1 thread." in md
    assert md.count("% stream") == 2  # the header's definition and the column
    if cpu.available():
        assert "against the targets" in md and "% of the host's streaming read" in md
