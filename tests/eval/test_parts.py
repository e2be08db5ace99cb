"""Evaluation parts: which (tasks, lengths, n) groups a command line runs."""

from __future__ import annotations

import pytest

from moend_fx.common.errors import MoendError
from moend_fx.eval.parts import EvalPart, choose_parts, describe_parts

PUBLISHED = (EvalPart(("passkey", "niah_single"), (2048, 4096), 30), EvalPart(("niah_single",), (7900,), 20))


def test_no_arguments_run_every_published_part():
    assert choose_parts(PUBLISHED) == PUBLISHED


def test_tasks_and_n_replace_each_parts_own():
    parts = choose_parts(PUBLISHED, n=2)
    assert [(p.lengths, p.n) for p in parts] == [((2048, 4096), 2), ((7900,), 2)]
    parts = choose_parts(PUBLISHED, tasks=["passkey"])
    assert [(p.tasks, p.n) for p in parts] == [(("passkey",), 30), (("passkey",), 20)]


def test_lengths_make_one_part_from_the_first_parts_tasks_and_n():
    assert choose_parts(PUBLISHED, lengths=[1024]) == (EvalPart(("passkey", "niah_single"), (1024,), 30),)
    assert choose_parts(PUBLISHED, lengths=[1024], tasks=["niah_single"], n=3) == (
        EvalPart(("niah_single",), (1024,), 3),)


def test_describe_names_tasks_lengths_and_n():
    assert describe_parts(PUBLISHED) == ("passkey, niah_single at 2048, 4096 tokens, n = 30; "
                                         "niah_single at 7900 tokens, n = 20")


@pytest.mark.parametrize("kwargs, match", [
    (dict(tasks=(), lengths=(2048,), n=1), "at least one task"),
    (dict(tasks=("passkey",), lengths=(), n=1), "at least one task and one length"),
    (dict(tasks=("passkey",), lengths=(2048,), n=0), "n=0 is invalid"),
])
def test_bad_parts_are_refused(kwargs, match):
    with pytest.raises(MoendError, match=match):
        EvalPart(**kwargs)


def test_no_published_parts_is_an_error():
    with pytest.raises(MoendError, match="no published"):
        choose_parts(())
