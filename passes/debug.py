"""Debug logging of graphs: ``logging`` at DEBUG level (logger ``moend_fx.passes``) and optional text dumps."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import torch.fx as fx

from moend_fx.common.io import atomic_write_text

log = logging.getLogger("moend_fx.passes")
_graph_ids = itertools.count()


def graph_id(gm: fx.GraphModule) -> str:
    """A stable name for one graph: dynamo's compile id when there is one (``0_1`` = frame 0, compile 1)."""
    if "moend_graph_id" not in gm.meta:
        cid = gm.meta.get("dynamo_compile_id")
        if cid is not None:
            name = f"{cid.frame_id}_{cid.frame_compile_id}"
        else:
            name = f"g{next(_graph_ids)}"
        gm.meta["moend_graph_id"] = name
    return gm.meta["moend_graph_id"]


def graph_text(gm: fx.GraphModule) -> str:
    return gm.print_readable(print_output=False, include_stride=False, include_device=True)


def dump_graph(gm: fx.GraphModule, stage: str, debug_dir: str | None) -> None:
    """Log the graph at DEBUG level and, if ``debug_dir`` is set, write it to ``<debug_dir>/graph_<id>_<stage>.txt``."""
    if log.isEnabledFor(logging.DEBUG):
        log.debug("graph %s %s:\n%s", graph_id(gm), stage, gm.graph)
    if debug_dir:
        atomic_write_text(Path(debug_dir) / f"graph_{graph_id(gm)}_{stage}.txt", graph_text(gm))
