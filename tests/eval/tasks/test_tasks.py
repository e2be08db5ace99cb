"""Offline task generators: length, determinism, needle placement, layouts, scoring, errors."""

from __future__ import annotations

import re
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moend_fx.common.errors import MoendError
from moend_fx.eval.tasks import text as tasks_text
from moend_fx.eval.tasks.aggregate import CommonWordsTask, VariableTrackingTask
from moend_fx.eval.tasks.base import Example, insert_needles
from moend_fx.eval.tasks.registry import SETTINGS, TASKS, depths_for, get_task, make_examples, score
from moend_fx.eval.tasks.retrieval import NiahTask, PasskeyTask

_TOKEN = re.compile(r"\w+|[^\w\s]")


class WordTokenizer:
    """Stand-in for a HF tokenizer: one token per word or punctuation mark."""

    def __call__(self, text: str) -> dict:
        return {"input_ids": [hash(t) % 1000 for t in _TOKEN.findall(text)]}


class CharEncoder:
    """A tokenizer with only `.encode` (one token per character), to cover that path."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


TOK = WordTokenizer()
# Longest filler unit in word tokens is a two-clause sentence (~25 tokens); a list item is ~3 tokens.
SLACK = 30


def _n(text: str) -> int:
    return len(_TOKEN.findall(text))


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("length", [400, 1500])
def test_length_lands_just_under_target(task, length):
    for ex in make_examples(task, TOK, length, n=3, seed=7):
        assert ex.meta["n_tokens"] == _n(ex.prompt_full)
        assert length - SLACK <= ex.meta["n_tokens"] <= length, ex.meta["n_tokens"]


def test_encode_only_tokenizer_is_supported():
    ex = make_examples("niah_single", CharEncoder(), 3000, n=1, seed=0)[0]
    assert 3000 - 200 <= len(ex.prompt_full) <= 3000  # 200 chars: one filler sentence at most


@pytest.mark.parametrize("task", list(TASKS))
def test_deterministic_for_a_seed_and_different_across_seeds(task):
    a = make_examples(task, TOK, 600, n=3, seed=3)
    b = make_examples(task, TOK, 600, n=3, seed=3)
    c = make_examples(task, TOK, 600, n=3, seed=4)
    assert a == b
    assert [x.prompt_full for x in a] != [x.prompt_full for x in c]
    # Example i does not depend on how many examples were asked for (depth aside).
    assert make_examples(task, TOK, 600, n=1, seed=3, depth=0.5)[0].answers == \
        make_examples(task, TOK, 600, n=2, seed=3, depth=0.5)[0].answers


@pytest.mark.parametrize("task", ["passkey", "niah_single", "niah_multikey", "niah_multivalue"])
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_needle_sits_at_requested_depth(task, depth):
    ex = make_examples(task, TOK, 1200, n=1, seed=1, depth=depth)[0]
    first = ex.answers[0]
    pos = re.search(rf"(?<!\d){first}(?!\d)", ex.context).start()
    measured = _n(ex.context[:pos]) / _n(ex.context)
    # 0.05: needle slots fall between filler sentences (~12 of ~1100 tokens) plus the needle's own length.
    assert abs(measured - depth) < 0.05, (measured, depth)
    assert abs(ex.meta["needle_depths"][0] - depth) < 0.05
    for a in ex.answers:
        assert len(re.findall(rf"(?<!\d){a}(?!\d)", ex.context)) == 1  # the passkey needle states it once


def test_multikey_has_distractors_and_multivalue_all_values():
    mk = make_examples(NiahTask(num_keys=3), TOK, 1000, n=1, seed=2)[0]
    assert len(mk.answers) == 1 and len(re.findall(r"special magic numbers for", mk.context)) == 3
    keys = mk.meta["keys"]
    assert len(set(keys)) == 3 and keys[0] in mk.question and not any(k in mk.question for k in keys[1:])
    mv = make_examples("niah_multivalue", TOK, 1000, n=1, seed=2)[0]
    assert len(mv.answers) == 2 and all(f"{mv.meta['keys'][0]} is: {v}." in mv.context for v in mv.answers)


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_variable_chain_in_order_at_depth(depth):
    cfg = VariableTrackingTask(num_chains=2, num_hops=3)
    ex = make_examples(cfg, TOK, 1500, n=1, seed=5, depth=depth)[0]
    value = ex.meta["value"]
    chain = ex.answers
    assert len(chain) == 4 and f"VAR {chain[0]} = {value}." in ex.context
    offsets = [ex.context.index(f"VAR {chain[0]} = {value}.")]
    offsets += [ex.context.index(f"VAR {chain[h]} = VAR {chain[h - 1]}.") for h in range(1, 4)]
    assert offsets == sorted(offsets)
    start = depth * (1 - cfg.spread)
    # 0.05 as for the needles: slots between sentences.
    assert abs(ex.meta["chain_depths"][0] - start) < 0.05
    assert abs(ex.meta["chain_depths"][-1] - (start + cfg.spread)) < 0.05
    assert len(re.findall(r"VAR [A-Z]{5} = \d+\.", ex.context)) == 2  # one distractor chain


def test_common_words_frequencies():
    cfg = CommonWordsTask(top_k=4, freq_common=15, freq_uncommon=3)
    ex = make_examples(cfg, TOK, 1500, n=1, seed=9)[0]
    items = re.findall(r"\d+\. ([a-z]+)", ex.context)
    assert len(items) == ex.meta["list_items"]
    counts = Counter(items)
    assert {w for w, c in counts.items() if c == 15} == set(ex.answers) and len(ex.answers) == 4
    assert max(c for w, c in counts.items() if w not in ex.answers) <= 3
    assert ex.meta["depth"] is None


def test_haystack_is_diverse_and_digit_free():
    ex = make_examples("niah_single", TOK, 2000, n=1, seed=0)[0]
    sents = [s for s in re.split(r"(?<=\.) ", ex.context) if "magic" not in s]
    assert len(set(sents)) > 0.6 * len(sents)  # seeded templates: few exact repeats
    assert not re.search(r"\d", " ".join(sents))


def test_license_haystack_falls_back_when_absent(monkeypatch, tmp_path):
    ex = make_examples(NiahTask(haystack="licenses"), TOK, 800, n=1, seed=0)[0]
    expected = "licenses" if tasks_text._license_sentences() else "sentences"
    assert ex.meta["haystack"] == expected
    monkeypatch.setattr(tasks_text, "LICENSE_DIR", tmp_path / "missing")
    ex = make_examples(NiahTask(haystack="licenses"), TOK, 800, n=1, seed=0)[0]
    assert ex.meta["haystack"] == "sentences" and ex.answers[0] in ex.context


@pytest.mark.parametrize("task", list(TASKS))
def test_layouts_place_question_once_in_the_right_part(task):
    ex = make_examples(task, TOK, 500, n=1, seed=1)[0]
    for setting in SETTINGS:
        pre, suf = ex.prefill_text(setting), ex.suffix_text(setting)
        assert pre + suf == ex.prompt_full
        assert suf.endswith(ex.answer_prefix) and ex.context in pre
        assert ex.prompt_full.count(ex.question) == 1
        assert (ex.question in pre) == (setting == "query_aware")
        assert (ex.question in suf) == (setting == "query_agnostic")
    assert ex.suffix_text("query_aware") == ex.answer_prefix


def _ex(answers, match="number", context="x"):
    return Example(task="t", intro="", context=context, question="q?", answer_prefix="A:",
                   answers=tuple(answers), match=match)


def test_score_numbers():
    ex = _ex(["38053"])
    assert score(ex, " 38053. Remember it.") == 1.0
    assert score(ex, " 380531") == 0.0  # digits must match exactly
    assert score(ex, " 12345, or maybe 38053") == 0.0  # strict: the first number is the answer
    assert score(ex, " 12345, or maybe 38053", strict=False) == 1.0
    assert score(ex, " I do not know.") == 0.0
    mv = _ex(["111111", "222222"])
    assert score(mv, " 222222 and 111111.") == 1.0
    assert score(mv, " 111111 and 333333 and 222222") == 0.5
    assert score(mv, " 111111 and 111111 and 222222") == 1.0  # repeats are not new candidates


def test_score_variables_and_words():
    vt = _ex(["ABCDE", "FGHIJ", "KLMNO"], match="variable")
    assert score(vt, " ABCDE, FGHIJ, KLMNO") == 1.0
    assert score(vt, " VAR ABCDE, VAR KLMNO and more") == pytest.approx(2 / 3)
    assert score(vt, " abcde") == 0.0  # variables are upper case
    cw = _ex(["apple", "river"], match="word", context="1. apple 2. river 3. stone 4. apple")
    assert score(cw, " 1. Apple 2. river") == 1.0  # list numbers and case do not matter
    assert score(cw, " stone, apple, river") == 0.5  # only the first two list words count
    assert score(cw, " the answer is apple") == 0.5  # words outside the list are ignored


@pytest.mark.parametrize("task", list(TASKS))
def test_generated_answers_score_one_and_wrong_score_zero(task):
    ex = make_examples(task, TOK, 500, n=1, seed=2)[0]
    assert score(ex, " " + ", ".join(ex.answers) + ".") == 1.0
    assert score(ex, " nothing useful here") == 0.0


@settings(max_examples=15, deadline=None)
@given(length=st.integers(200, 1200), seed=st.integers(0, 10**6), depth=st.floats(0.0, 1.0))
def test_niah_any_length_seed_depth(length, seed, depth):
    ex = make_examples("niah_multikey", TOK, length, n=1, seed=seed, depth=depth)[0]
    assert length - SLACK <= ex.meta["n_tokens"] <= length
    assert ex.answers[0] in ex.context and score(ex, f" {ex.answers[0]}.") == 1.0


def test_insert_needles_offsets():
    text, offs = insert_needles(["a.", "b.", "c."], [("X", 1.0), ("Y", 0.0), ("Z", 0.5)])
    assert text == "Y a. b. Z c. X"  # slot round(0.5 * 3) = 2 (round half to even)
    assert [text[o] for o in offs] == ["X", "Y", "Z"]


def test_depths_for():
    assert depths_for(1) == [0.5]
    assert depths_for(5) == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert depths_for(3, 0.2) == [0.2, 0.2, 0.2]


def test_bad_input_raises():
    with pytest.raises(MoendError, match="allowed: passkey, niah_single"):
        make_examples("nope", TOK, 500, n=1)
    with pytest.raises(MoendError, match="allowed"):
        get_task(object())
    with pytest.raises(MoendError, match="too short"):
        make_examples("passkey", TOK, 20, n=1)
    with pytest.raises(MoendError, match="depth"):
        make_examples("passkey", TOK, 500, n=1, depth=1.5)
    with pytest.raises(MoendError, match="n=0"):
        make_examples("passkey", TOK, 500, n=0)
    ex = make_examples("passkey", TOK, 300, n=1)[0]
    with pytest.raises(MoendError, match="query_aware, query_agnostic"):
        ex.prefill_text("both")
    with pytest.raises(MoendError, match="haystack"):
        PasskeyTask(haystack="lorem")
    with pytest.raises(MoendError, match="num_keys"):
        NiahTask(num_keys=0)
    with pytest.raises(MoendError, match="freq_common"):
        CommonWordsTask(freq_common=2, freq_uncommon=2)
    with pytest.raises(MoendError, match="spread"):
        VariableTrackingTask(spread=1.5)
    with pytest.raises(MoendError, match="match"):
        _ex(["1"], match="regex")


# ------------------------------------------------------------------------------------------- real tokenizer

@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from moend_fx.models import converted_dir, load_model

    folder = converted_dir()
    if not (folder / "tokenizer_config.json").is_file():
        load_model()  # converts the embedded GGUF once into the cache folder
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("length", [2048, 4096])
def test_real_tokenizer_lengths_and_split(smollm2_tokenizer, length):
    tok = smollm2_tokenizer
    for task in TASKS:
        for ex in make_examples(task, tok, length, n=2, seed=0):
            n = len(tok(ex.prompt_full)["input_ids"])
            assert 0.98 * length <= n <= length, (task, n)  # the brief's 2% tolerance
            for setting in SETTINGS:
                # Tokenizing prefill and suffix apart gives the same tokens as the whole prompt.
                ids = tok(ex.prefill_text(setting))["input_ids"] + \
                    tok(ex.suffix_text(setting), add_special_tokens=False)["input_ids"]
                assert ids == tok(ex.prompt_full)["input_ids"], (task, setting)
