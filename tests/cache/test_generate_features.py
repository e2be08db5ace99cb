"""The generate() features users reach for, each on a prepared model (issue 58): greedy, top-p sampling,
num_return_sequences=3, beam search, reusing the returned cache for a second turn, stop_strings, TextStreamer,
pipeline("text-generation"), a chat template, assisted generation and prompt-lookup decoding.

What each promises is asserted against a reference:
* a lossless plan (16-bit K/V, every token kept) gives the unprepared model's (DynamicCache) output exactly: the
  cache reads K/V from 16-bit storage (fp16 for these fp32 tiny models), ~3e-5 off, below their argmax margins,
  and sampling draws from the same seeded generator;
* a compressed plan (half the tokens, 4-bit K/V, capacity mode) gives, for the features
  that are greedy decoding in another form (streamer, pipeline, chat template, stop strings, assisted, prompt
  lookup), the prepared model's own greedy tokens; for sampling and beams the shapes, and the budget at the end;
* compiled (``model.compile(backend="moend")``, aot_eager inner compiler): the eager compressed outputs.
"""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, TextStreamer, pipeline

from moend_fx.cache.generation import prepare, unprepare
from moend_fx.cache.moend_cache import MoENDCache
from moend_fx.models import tiny_model, uncompile
from moend_fx.plan.routing import LayerConfig, ModelFingerprint, RoutingPlan

N = 24  # new tokens
KW = dict(max_new_tokens=N, min_new_tokens=N, pad_token_id=0)
CHARS = [chr(0x41 + i) if i < 26 else chr(0x61 + i - 26) if i < 52 else chr(0x100 + i) for i in range(256)]


def _tokenizer() -> PreTrainedTokenizerFast:
    """One character per token id of the tiny models' 256-token vocabulary, and a chat template."""
    tk = Tokenizer(models.WordLevel(vocab={c: i for i, c in enumerate(CHARS)}, unk_token=CHARS[0]))
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.Split("", "isolated"), decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token=CHARS[0], bos_token=CHARS[1], eos_token=CHARS[2])
    tok.chat_template = ("{% for m in messages %}{{ m['role'][0] }}{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}a{% endif %}")
    return tok


TOK = _tokenizer()
PROMPT = "".join(CHARS[i] for i in torch.randint(3, 256, (70,), generator=torch.Generator().manual_seed(1)))


def _ids() -> torch.Tensor:
    return TOK(PROMPT, return_tensors="pt").input_ids


def _draft():
    draft = tiny_model("llama", num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16)
    draft.generation_config.num_assistant_tokens = 4
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    return draft


def _gen(model, ids=None, **kw):
    return model.generate(_ids() if ids is None else ids, **{**KW, **kw})


def _sample(model, **kw):
    torch.manual_seed(7)
    return _gen(model, do_sample=True, top_p=0.9, **kw)


def _second_turn(model):
    first = _gen(model, do_sample=False, return_dict_in_generate=True)
    more = torch.cat([first.sequences, _ids()[:, :5]], dim=1)
    out = model.generate(more, cache=first.cache, do_sample=False, return_dict_in_generate=True, **KW)
    return out.sequences, out.cache


def _stop(model):
    greedy = _gen(model, do_sample=False)[0, _ids().shape[1]:]
    stop = TOK.decode(greedy[8:10])  # a string the greedy continuation reaches at its 10th token
    return model.generate(_ids(), do_sample=False, stop_strings=[stop], tokenizer=TOK, max_new_tokens=N, pad_token_id=0)


def _stream(model, capsys):
    capsys.readouterr()
    _gen(model, do_sample=False, streamer=TextStreamer(TOK))
    return capsys.readouterr().out.strip()


def _pipe(model):
    text = pipeline("text-generation", model=model, tokenizer=TOK)(PROMPT, do_sample=False, **KW)
    return text[0]["generated_text"]


def _chat(model):
    ids = TOK.apply_chat_template([{"role": "user", "content": PROMPT[:40]}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    return _gen(model, ids, do_sample=False)


FEATURES = {
    "greedy": lambda m, c: _gen(m, do_sample=False),
    "top_p": lambda m, c: _sample(m),
    "num_return_sequences": lambda m, c: _sample(m, num_return_sequences=3),
    "beam_search": lambda m, c: _gen(m, do_sample=False, num_beams=3),
    "second_turn": lambda m, c: _second_turn(m)[0],
    "stop_strings": lambda m, c: _stop(m),
    "text_streamer": _stream,
    "pipeline": lambda m, c: _pipe(m),
    "chat_template": lambda m, c: _chat(m),
    "assisted": lambda m, c: _gen(m, do_sample=False, assistant_model=_draft()),
    "prompt_lookup": lambda m, c: _gen(m, do_sample=False, prompt_lookup_num_tokens=3),
}
# what each is, decoded greedily, on the same prompt (None: not greedy decoding)
GREEDY = {"greedy": "greedy", "assisted": "greedy", "prompt_lookup": "greedy", "text_streamer": "text",
          "pipeline": "text", "stop_strings": "prefix", "chat_template": None, "second_turn": None}


def _model():
    torch.manual_seed(0)
    return tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)


def _plan(model, cfg, context_length: int = 128) -> RoutingPlan:
    return RoutingPlan.uniform(cfg, ModelFingerprint.from_model(model), context_length, group_size=8, scorer="snapkv")


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_a_lossless_plan_gives_the_unprepared_models_output(feature, capsys):
    model = _model()
    want = FEATURES[feature](model, capsys)
    prepare(model, _plan(model, LayerConfig(1.0, 16, 16), 256))  # room for every token: nothing evicted
    got = FEATURES[feature](model, capsys)
    unprepare(model)
    assert type(got) is type(want)
    assert got == want if isinstance(got, str) else torch.equal(got, want)


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_a_compressed_plan_serves_every_feature(feature, capsys):
    """Half the tokens at 4 bits (the 70-token prompt evicted to 36 at prefill), a 128-token plan, reserve 4.

    The plan keeps decoding free of evictions; evictions and K groups inside verify steps are covered by
    tests/cache/test_crop.py (each verify row attends as one-by-one decoding does, docs/cache.md)."""
    model = _model()
    plan = _plan(model, LayerConfig(0.5, 4, 4))
    prepare(model, plan, reserve=4)
    got = FEATURES[feature](model, capsys)
    greedy = _gen(model, do_sample=False)
    text = TOK.decode(greedy[0])
    kind = GREEDY.get(feature)
    if kind == "greedy":
        assert torch.equal(got, greedy)
    elif kind == "text":
        assert got == text
    elif kind == "prefix":  # stopped at the stop string, greedy up to there
        assert got.shape[1] == _ids().shape[1] + 10 and torch.equal(got, greedy[:, : got.shape[1]])
    elif feature == "beam_search" or feature == "top_p":
        assert got.shape == (1, _ids().shape[1] + N)
    elif feature == "num_return_sequences":
        assert got.shape == (3, _ids().shape[1] + N)
    elif feature == "second_turn":
        seq, cache = _second_turn(model)
        assert torch.equal(seq, got) and seq.shape[1] == _ids().shape[1] + N + 5 + N
        assert isinstance(cache, MoENDCache) and cache.nbytes().total <= cache.budget_bytes().total
    else:
        assert feature == "chat_template" and got.shape[1] == TOK.apply_chat_template(
            [{"role": "user", "content": PROMPT[:40]}], add_generation_prompt=True, return_dict=True,
            return_tensors="pt")["input_ids"].shape[1] + N
    unprepare(model)


@pytest.mark.parametrize("feature", ["greedy", "top_p", "beam_search", "second_turn", "prompt_lookup"])
def test_compiled_gives_the_eager_output(feature, capsys):
    model = _model()
    plan = _plan(model, LayerConfig(0.5, 4, 4))
    prepare(model, plan, reserve=4)
    want = FEATURES[feature](model, capsys)
    torch._dynamo.reset()
    try:
        model.compile(backend="moend", options={"inner": "aot_eager", "plan": plan})
        got = FEATURES[feature](model, capsys)
    finally:
        torch._dynamo.reset()
        uncompile(model)
        unprepare(model)
    assert torch.equal(got, want)
