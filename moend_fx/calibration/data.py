"""Calibration and held-out text that needs no download: licence texts on the machine plus generated records.

Two sources, mixed into every sequence (see ``docs/calibration.md``):

* **Licences**: the long licence texts Debian-based systems install in ``/usr/share/common-licenses``
  (found at run time; duplicates such as ``GPL`` -> ``GPL-3`` dropped by content). Real, long, English prose
  with cross references. The sorted unique files are split in two disjoint halves: even positions feed the
  ``"calibration"`` split, odd positions the ``"heldout"`` split. If the folder is missing, only the synthetic
  source is used (the table's metadata records which licences went in).
* **Synthetic long context**: seeded key/value records ("the access code of the amber archive is 48213"),
  filler prose built from word lists, and questions about records far back, so attention must reach
  across the whole sequence (the retrieval pattern that long-context tasks stress). A calibration sequence
  can end with such questions (``tail``), so that the queries whose attention error S measures retrieve.

Everything is a pure function of ``(seed, split, index)``: same arguments, same tokens.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moend_fx.common.errors import MoendError

LICENSE_DIR = Path("/usr/share/common-licenses")
SPLITS = ("calibration", "heldout")

_ADJ = ("amber", "silent", "northern", "crimson", "hollow", "rapid", "ancient", "frozen", "golden", "hidden",
        "lunar", "quiet", "rusty", "scarlet", "solar", "velvet", "wooden", "bright", "distant", "narrow")
_NOUN = ("archive", "harbor", "engine", "garden", "ledger", "lantern", "bridge", "tower", "orchard", "vault",
         "compass", "meadow", "canal", "forge", "library", "station", "beacon", "cellar", "pier", "mill")
_ATTR = ("access code", "serial number", "room number", "batch id", "pass number", "vault code", "order id",
         "ticket number")
_SUBJ = ("The committee", "A small team", "The engineer", "Every visitor", "The old map", "Our records",
         "The report", "A careful reader", "The council", "The inspector")
_VERB = ("noted that", "explained why", "argued that", "remembered how", "checked whether", "described how",
         "confirmed that", "wondered if")
_CLAUSE = ("the river had risen during the night", "the shipment arrived two days late",
           "the north wall needed repairs before winter", "the budget was spent on new lamps",
           "the ledger listed every transfer in order", "the bell rang twice at noon",
           "the garden path was closed for a week", "the storage room was finally sorted",
           "the last train left without passengers", "the map showed a second entrance",
           "the measurements matched the earlier survey", "nobody had opened the cellar in years")


@dataclass(frozen=True)
class License:
    name: str
    text: str
    sha256: str


def license_texts(folder: str | os.PathLike | None = None) -> list[License]:
    """Unique licence texts in ``folder`` (default ``/usr/share/common-licenses``), sorted by file name.

    Files with identical content (symlinks such as ``GPL`` -> ``GPL-3``) appear once, under the name that
    sorts last (the versioned one). Missing folder: an empty list.
    """
    root = Path(folder) if folder is not None else LICENSE_DIR
    if not root.is_dir():
        return []
    by_hash: dict[str, License] = {}
    for p in sorted(root.iterdir(), key=lambda q: q.name):
        if not p.is_file():
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) < 1000:  # too short to be useful context
            continue
        h = hashlib.sha256(text.encode("utf-8")).hexdigest()
        by_hash[h] = License(p.name, text, h)
    return sorted(by_hash.values(), key=lambda lic: lic.name)


def split_licenses(split: str, folder: str | os.PathLike | None = None) -> list[License]:
    """The licences of one split: even positions for ``"calibration"``, odd for ``"heldout"``."""
    _check_split(split)
    lics = license_texts(folder)
    return lics[SPLITS.index(split)::2]


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise MoendError(f"split={split!r} is unknown; allowed: {list(SPLITS)}")


def synthetic_document(rng: random.Random, num_records: int = 40) -> str:
    """Records, filler prose and questions about earlier records (answers included, teacher-forced)."""
    records = []
    used: set[tuple[str, str, str]] = set()
    while len(records) < num_records:
        key = (rng.choice(_ADJ), rng.choice(_NOUN), rng.choice(_ATTR))
        if key in used:
            continue
        used.add(key)
        records.append((key, rng.randrange(10000, 99999)))
    lines: list[str] = []
    for i, ((adj, noun, attr), val) in enumerate(records):
        lines.append(f"Record {i + 1}: the {attr} of the {adj} {noun} is {val}.")
        if rng.random() < 0.5:
            lines.append(_prose(rng, rng.randint(1, 3)))
    lines.append(_prose(rng, rng.randint(4, 8)))
    for _ in range(max(1, num_records // 4)):
        (adj, noun, attr), val = rng.choice(records)
        lines.append(f"Question: what is the {attr} of the {adj} {noun}? Answer: {val}.")
    return "\n".join(lines)


def _prose(rng: random.Random, sentences: int) -> str:
    return " ".join(f"{rng.choice(_SUBJ)} {rng.choice(_VERB)} {rng.choice(_CLAUSE)}." for _ in range(sentences))


def _license_excerpt(rng: random.Random, lic: License, chars: int) -> str:
    text = lic.text
    if len(text) <= chars:
        return text
    # start at a paragraph boundary so excerpts read like documents
    starts = [0] + [i + 2 for i in range(len(text) - 2) if text[i:i + 2] == "\n\n" and i + 2 < len(text) - chars]
    s = rng.choice(starts)
    return text[s:s + chars]


def sequence_text(seed: int, split: str, index: int, approx_chars: int,
                  folder: str | os.PathLike | None = None) -> tuple[str, list[str]]:
    """The text of sequence ``index`` of ``split`` (at least ``approx_chars`` characters) and the licences used.

    Alternates a licence excerpt (about half the characters) with synthetic documents.
    """
    _check_split(split)
    rng = random.Random(f"moend-calib/{seed}/{split}/{index}")
    lics = split_licenses(split, folder)
    parts: list[str] = []
    used: list[str] = []
    total = 0
    turn = 0
    while total < approx_chars:
        if lics and turn % 2 == 0:
            lic = rng.choice(lics)
            part = _license_excerpt(rng, lic, max(2000, approx_chars // 2))
            used.append(lic.name)
        else:
            part = synthetic_document(rng, num_records=rng.randint(20, 60))
        parts.append(part)
        total += len(part) + 2
        turn += 1
    return "\n\n".join(parts), used


_RECORD = re.compile(r"Record \d+: the ([a-z ]+?) of the ([a-z]+) ([a-z]+) is (\d+)\.")


def retrieval_tail(tokenizer: Any, prefix: torch.Tensor, tokens: int, rng: random.Random) -> torch.Tensor | None:
    """``tokens`` token ids [tokens] of questions, with their answers, about records in ``prefix`` [T] (earlier
    in the same sequence), or None when it holds no record. Ending a calibration sequence with them puts
    retrieval queries in the window whose attention error S measures: a layer that drops a fact then shows it."""
    found = _RECORD.findall(tokenizer.decode(prefix.tolist()))
    if not found:
        return None
    out: list[int] = []
    while len(out) < tokens:
        attr, adj, noun, val = rng.choice(found)
        q = f"\nQuestion: what is the {attr} of the {adj} {noun}? Answer: {val}."
        out += tokenizer(q, add_special_tokens=False)["input_ids"]
    return torch.tensor(out[:tokens], dtype=torch.int64)


def text_token_sequences(tokenizer: Any, num_sequences: int, tokens: int, *, seed: int = 0,
                         split: str = "calibration", folder: str | os.PathLike | None = None,
                         tail: int = 0, tail_sequences: int | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """``num_sequences`` sequences of exactly ``tokens`` token ids: [N, tokens] int64, plus a source record.
    tail: the last ``tail`` tokens of the first ``tail_sequences`` sequences (None: all) are :func:`retrieval_tail`
    questions about that sequence's earlier records; the others stay plain text."""
    _check_positive("num_sequences", num_sequences)
    _check_positive("tokens", tokens)
    rows: list[torch.Tensor] = []
    used: list[str] = []
    tails = 0
    for i in range(num_sequences):
        chars = 5 * tokens
        while True:
            text, lic = sequence_text(seed, split, i, chars, folder)
            ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
            if ids.numel() >= tokens:
                break
            chars *= 2  # a tokenizer with long tokens: generate more text (deterministically)
        ids = ids[:tokens].to(torch.int64)
        if 0 < tail < tokens and (tail_sequences is None or i < tail_sequences):
            rng = random.Random(f"moend-calib-tail/{seed}/{split}/{i}")
            t = retrieval_tail(tokenizer, ids[: tokens - tail], tail, rng)
            if t is not None:
                ids, tails = torch.cat([ids[: tokens - tail], t]), tails + 1
        rows.append(ids)
        used.extend(lic)
    source = {"kind": "text", "split": split, "seed": seed, "licenses": sorted(set(used)),
              "license_dir": str(folder or LICENSE_DIR), "retrieval_tail_tokens": tail,
              "sequences_with_tail": tails}
    return torch.stack(rows), source


def random_token_sequences(vocab_size: int, num_sequences: int, tokens: int, *, seed: int = 0,
                           split: str = "calibration") -> tuple[torch.Tensor, dict[str, Any]]:
    """Seeded uniform random token ids [N, tokens] (for tiny random-weight models without a tokenizer)."""
    _check_positive("vocab_size", vocab_size)
    _check_positive("num_sequences", num_sequences)
    _check_positive("tokens", tokens)
    _check_split(split)
    g = torch.Generator().manual_seed(seed * 2 + SPLITS.index(split))
    ids = torch.randint(0, vocab_size, (num_sequences, tokens), generator=g, dtype=torch.int64)
    return ids, {"kind": "random", "split": split, "seed": seed}


def token_sequences(model: Any, tokenizer: Any | None, num_sequences: int, tokens: int, *, seed: int = 0,
                    split: str = "calibration", tail: int = 0, tail_sequences: int | None = None,
                    ) -> tuple[torch.Tensor, dict[str, Any]]:
    """Text sequences when a tokenizer is given (``tail``, ``tail_sequences``: :func:`text_token_sequences`),
    else random ids over the model's vocabulary."""
    if tokenizer is not None:
        return text_token_sequences(tokenizer, num_sequences, tokens, seed=seed, split=split, tail=tail,
                                    tail_sequences=tail_sequences)
    return random_token_sequences(int(model.config.vocab_size), num_sequences, tokens, seed=seed, split=split)


def _check_positive(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise MoendError(f"{name}={v!r} is invalid; allowed: a positive integer")
