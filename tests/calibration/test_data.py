"""Calibration text: a retrieval tail of questions about the sequence's own earlier records."""

from __future__ import annotations

import re

import torch

from moend_fx.calibration.data import text_token_sequences


class ByteTok:
    """A byte-level stand-in for a HF tokenizer (encode and decode)."""

    def __call__(self, text, return_tensors=None, add_special_tokens=False):
        ids = list(text.encode("utf-8"))
        return {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids}

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_the_tail_asks_about_records_earlier_in_the_same_sequence(tmp_path):
    # no licence folder: synthetic documents only (a byte "token" per character would fit only licence text)
    tok, tokens, tail = ByteTok(), 6000, 400
    plain, _ = text_token_sequences(tok, 2, tokens, seed=3, folder=tmp_path)
    tailed, src = text_token_sequences(tok, 2, tokens, seed=3, tail=tail, folder=tmp_path)
    assert tailed.shape == plain.shape == (2, tokens)
    assert src["retrieval_tail_tokens"] == tail and src["sequences_with_tail"] == 2
    assert torch.equal(tailed[:, : tokens - tail], plain[:, : tokens - tail])  # only the tail differs
    for row in tailed:
        head, end = tok.decode(row[: tokens - tail].tolist()), tok.decode(row[tokens - tail:].tolist())
        asked = re.findall(r"what is the ([a-z ]+?) of the ([a-z]+ [a-z]+)\? Answer: (\d+)\.", end)
        assert len(asked) >= 3
        for attr, thing, val in asked:  # every question's answer is a record stated earlier
            assert f"the {attr} of the {thing} is {val}." in head
    again, _ = text_token_sequences(tok, 2, tokens, seed=3, tail=tail, folder=tmp_path)
    assert torch.equal(again, tailed)  # deterministic per seed


def test_no_tail_without_records_to_ask_about():
    tok = ByteTok()
    ids, src = text_token_sequences(tok, 1, 300, seed=7, tail=100)  # 200 bytes of licence text: no record
    plain, _ = text_token_sequences(tok, 1, 300, seed=7)
    assert src["sequences_with_tail"] == 0 and torch.equal(ids, plain)


def test_only_the_first_tail_sequences_end_with_a_tail(tmp_path):
    # `moend calibrate --retrieval-tails 1`: one tailed sequence, the rest plain text (measured in docs/calibration.md)
    tok, tokens, tail = ByteTok(), 6000, 400
    plain, _ = text_token_sequences(tok, 3, tokens, seed=3, folder=tmp_path)
    mixed, src = text_token_sequences(tok, 3, tokens, seed=3, tail=tail, tail_sequences=1, folder=tmp_path)
    all_tailed, _ = text_token_sequences(tok, 3, tokens, seed=3, tail=tail, folder=tmp_path)
    assert src["sequences_with_tail"] == 1
    assert torch.equal(mixed[0], all_tailed[0]) and not torch.equal(mixed[0], plain[0])
    assert torch.equal(mixed[1:], plain[1:])
