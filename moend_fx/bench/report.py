"""``docs/results.md`` from per-benchmark sections: one section per benchmark, each headed by the command
that regenerates it.

Every benchmark writes its section into ``<results>/sections/<key>.md`` (with ``<key>.json`` beside it: the
command, the time, the files). :func:`render_results` rebuilds the document from a fixed template in
:data:`SECTIONS` order, taking each section from, in turn: the results folder; the block of the same key in
the existing document (between ``<!-- section:KEY -->`` and ``<!-- /section:KEY -->``), so benchmarks that
were not re-run keep their published text, and so does the hand-written text between the sections; a new
document gets a placeholder saying how to produce each section not run. A hand-written
reading of a section's numbers lives in ``results-notes/<key>.md`` beside the document and is appended to
the section each time it is rendered.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from moend_fx.common.errors import MoendError
from moend_fx.common.io import atomic_write_bytes, atomic_write_text


@dataclass(frozen=True)
class SectionSpec:
    key: str
    title: str
    default_command: str
    about: str


SECTIONS: tuple[SectionSpec, ...] = (
    SectionSpec("decode", "Decode speed and memory", "moend bench decode",
                "Per-token decode time and memory at long context: full cache vs MoENDCache, eager vs compiled."),
    SectionSpec("prefill", "Long prompts: chunked vs one-shot prefill", "moend bench prefill",
                "Time, peak RSS growth and accuracy of a long prompt's prefill, in chunks compressed as they go vs "
                "in one pass."),
    SectionSpec("eval", "Accuracy vs memory", "moend bench eval",
                "Long-context accuracy of each method at matched measured cache memory."),
    SectionSpec("solvers", "Solvers: speed and optimality gaps", "moend bench solvers",
                "Predicted loss of each solver against the exact optimum, and solve times."),
    SectionSpec("proxy", "Calibration proxy vs end-to-end KL", "moend bench proxy",
                "Does the sensitivity table predict quality? Predicted loss (sum over layers of gain * S^2, an "
                "end-to-end KL estimate; the paper's sum of S for a table without gains) against the measured KL "
                "of next-token distributions vs the full cache, and the per-layer spread of S."),
    SectionSpec("search", "Measured plan search: is greedy end-to-end optimal?", "moend bench search",
                "Greedy and exact plans against the best plan an Optuna search finds on measured continuation KL "
                "around them, under the same byte budget, re-measured on held-out sequences."),
    SectionSpec("heads", "Per-KV-head budgets (Ada-KV) inside MoE-nD's plans", "moend bench heads",
                "Heads of a layer sharing its tokens by score instead of keeping one count each: the real cache "
                "against a simulated cache with one count per head and with counts per head, at the same plan and "
                "storage bytes."),
    SectionSpec("calibrate", "Calibration time", "moend bench calibrate",
                "Wall time to measure the sensitivity table S[layer, config]."),
    SectionSpec("kernels", "Decode attention kernels", "moend bench kernels",
                "One decode attention call over a compressed layer: fused CPU kernel vs SDPA vs dequantize+SDPA."),
    SectionSpec("triton", "Decode attention on a GPU (Triton)", "moend bench triton",
                "One decode attention call on a CUDA GPU: the Triton kernel over a compressed layer vs fp16 SDPA."),
)
KEYS: tuple[str, ...] = tuple(s.key for s in SECTIONS)

HEADER = """# Results

Every table and plot below comes from `moend bench`; each section starts with the exact command that
regenerates it, and `moend bench all` regenerates them all (then this file). The machine is shared and
timings move by up to ~25% between runs: compare rows of one run and read the ratios, not the absolute
milliseconds. Memory ratios are against a 16-bit cache of the same tokens (the paper's base) unless a column
says "model dtype".

Do not edit the sections by hand: they are rewritten from the results folder.
"""

_BLOCK = re.compile(r"<!-- section:(?P<key>[a-z_]+) -->\n(?P<body>.*?)<!-- /section:(?P=key) -->", re.S)


def _spec(key: str) -> SectionSpec:
    for s in SECTIONS:
        if s.key == key:
            return s
    raise MoendError(f"benchmark section {key!r} is unknown; allowed: {', '.join(KEYS)}")


def section_dir(results_dir: str | os.PathLike) -> Path:
    return Path(results_dir) / "sections"


def write_section(results_dir: str | os.PathLike, key: str, command: str, markdown: str,
                  files: dict[str, str | os.PathLike] | None = None) -> Path:
    """Store one benchmark's section (``markdown`` = its tables; ``files`` = outputs such as a PNG, linked
    from the section) in ``<results_dir>/sections/``. Returns the section's Markdown path."""
    _spec(key)
    d = section_dir(results_dir)
    meta = {"key": key, "command": command, "written": time.strftime("%Y-%m-%d %H:%M:%S"),
            "files": {k: str(v) for k, v in (files or {}).items()}}
    atomic_write_text(d / f"{key}.json", json.dumps(meta, indent=1) + "\n")
    return atomic_write_text(d / f"{key}.md", markdown.rstrip() + "\n")


def section_block(key: str, command: str, markdown: str, *, written: str | None = None,
                  images: list[str] | tuple[str, ...] = (), notes: str | None = None) -> str:
    """One section of the document: title, the regenerating command, the body, the images, then the
    hand-written ``notes`` (a reading of the numbers; kept in ``results-notes/<key>.md`` beside the document
    so that a re-run keeps them, dated so a reader can tell when they were written)."""
    spec = _spec(key)
    lines = [f"## {spec.title}", "", spec.about, "", "Regenerate with:", "", "```", command, "```", ""]
    if written:
        lines += [f"_Last run: {written}._", ""]
    lines += [_demote(markdown.rstrip()), ""]
    for img in images:
        lines += [f"![{spec.title}]({img})", ""]
    if notes and notes.strip():
        lines += [notes.rstrip(), ""]
    return "\n".join(lines)


def _demote(markdown: str, top: int = 3) -> str:
    """Renumber the body's heading levels, in order, from ``top`` (the section title is level 2): a benchmark's
    own report starts with "# ...", which must not become a second document title, and skipped levels close up."""
    levels = sorted({len(m.group(1)) for m in re.finditer(r"^(#{1,6}) ", markdown, re.M)})
    new = {lvl: min(6, top + i) for i, lvl in enumerate(levels)}
    return re.sub(r"^(#{1,6}) ", lambda m: "#" * new[len(m.group(1))] + " ", markdown, flags=re.M)


def notes_path(doc: Path, key: str) -> Path:
    """Where the hand-written reading of section ``key`` lives: ``<doc dir>/results-notes/<key>.md``."""
    return doc.parent / "results-notes" / f"{key}.md"


def _placeholder(spec: SectionSpec) -> str:
    return section_block(spec.key, spec.default_command, "_Not run yet: run the command above._")


def existing_blocks(doc_text: str) -> dict[str, str]:
    """``{key: block text}`` of the marked sections of an existing document."""
    return {m.group("key"): m.group("body") for m in _BLOCK.finditer(doc_text)}


def _publish_image(png: Path, doc: Path, key: str) -> str:
    """Copy a plot next to the document (``img/<key>-<name>``; results folders are not committed) and return
    its link relative to the document."""
    dest = doc.parent / "img" / f"{key}-{png.name}"
    if png.resolve() != dest.resolve():
        atomic_write_bytes(dest, png.read_bytes())
    return os.path.relpath(dest, doc.parent)


def _stored_block(d: Path, spec: SectionSpec, doc: Path) -> str | None:
    """The section ``spec`` rendered from a results folder's ``sections/``; None when it holds none."""
    md_path, meta_path = d / f"{spec.key}.md", d / f"{spec.key}.json"
    if not (md_path.is_file() and meta_path.is_file()):
        return None
    meta = json.loads(meta_path.read_text())
    images = [_publish_image(Path(p), doc, spec.key)
              for k, p in meta.get("files", {}).items() if str(p).endswith(".png") and Path(p).is_file()]
    notes = notes_path(doc, spec.key)
    return section_block(spec.key, meta["command"], md_path.read_text(), written=meta.get("written"),
                         images=images, notes=notes.read_text() if notes.is_file() else None)


def _marked(key: str, body: str) -> str:
    return f"<!-- section:{key} -->\n{body.rstrip()}\n<!-- /section:{key} -->\n"


def render_results(results_dir: str | os.PathLike, doc_path: str | os.PathLike) -> Path:
    """Rewrite ``doc_path`` from the sections stored in ``results_dir``. A new document is built from the
    template (every section, placeholders for those not run). An existing document keeps its own text: each
    re-run section replaces its marked block in place (or is appended when the document has none), so the
    hand-written text between sections and the sections not re-run stay as they are. Plots are copied to
    ``img/`` beside the document."""
    doc = Path(doc_path)
    d = section_dir(results_dir)
    if not doc.is_file():
        parts = [HEADER] + [_marked(s.key, _stored_block(d, s, doc) or _placeholder(s)) for s in SECTIONS]
        return atomic_write_text(doc, "\n".join(parts))
    text = doc.read_text()
    for spec in SECTIONS:
        body = _stored_block(d, spec, doc)
        if body is None:
            continue
        pattern = re.compile(rf"<!-- section:{spec.key} -->\n.*?<!-- /section:{spec.key} -->\n?", re.S)
        if pattern.search(text):
            block = _marked(spec.key, body)
            text = pattern.sub(lambda _, block=block: block, text, count=1)
        else:
            text = text.rstrip() + "\n\n" + _marked(spec.key, body)
    return atomic_write_text(doc, text)
