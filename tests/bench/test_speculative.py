"""moend bench speculative's library part on a tiny model: three rows per context and batch, self-spec decodes the
full cache's greedy tokens in every row, ratios against the same run's full-cache row, the batch's prompts share
their start, JSON + Markdown written."""

from __future__ import annotations

import json

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from moend_fx.bench.speculative import (
    SpeculativeBenchSettings,
    batch_prompts,
    bench_speculative,
    prompt_ids,
    write_results,
)
from moend_fx.models import tiny_model
from moend_fx.plan.routing import LayerConfig


def _tokenizer() -> PreTrainedTokenizerFast:
    chars = [chr(0x20 + i) for i in range(95)]  # printable ASCII, one token each (the licence text's characters)
    tk = Tokenizer(models.WordLevel(vocab={c: i for i, c in enumerate(chars)}, unk_token=chars[0]))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token=chars[0])


def test_bench_speculative_rows_and_files(tmp_path):
    torch.manual_seed(0)
    model = tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    tok = _tokenizer()
    ids = prompt_ids(tok, 90)
    assert ids.shape == (1, 90) and len(set(ids[0].tolist())) > 10  # real text, not one repeated token
    batch = batch_prompts(tok, 90, 3, 20)
    assert batch.shape == (3, 90) and (batch[:, :70] == batch[:1, :70]).all()  # the shared start
    assert all((batch[r, 70:] != batch[0, 70:]).any() for r in (1, 2))  # each row's own end
    settings = SpeculativeBenchSettings(contexts=(80, 120), batches=(1, 3), new_tokens=12, draft_tokens=3,
                                        uniform=LayerConfig(0.5, 4, 4), own_tokens=20)
    result = bench_speculative(model, tok, settings, lock=str(tmp_path / "lock"), log=lambda s: None)
    rows = result["rows"]
    assert [(r["context"], r["batch"], r["method"]) for r in rows] == [
        (n, b, m) for n in (80, 120) for b in (1, 3) for m in ("full", "moend", "self-spec")]
    for r in rows:
        assert r["new_tokens"] == 12 and r["tokens_per_s"] > 0
    spec = [r for r in rows if r["method"] == "self-spec"]
    assert all(r["same_as_full"] and 0 <= r["acceptance"] <= r["row_acceptance"] <= 1 for r in spec)
    assert all(r["speed_vs_full"] == 1.0 for r in rows if r["method"] == "full")
    files = write_results(result, tmp_path, "moend bench speculative --contexts 80,120")
    assert json.loads((tmp_path / "speculative.json").read_text())["rows"] == rows
    assert "| 120 | 3 | self-spec |" in (tmp_path / "speculative.md").read_text() and set(files) == {"json", "markdown"}
