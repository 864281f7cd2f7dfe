"""Sessions are bound to the stream that opened them, and every hop of a route has its own id.

Issue 14, finding 2: a second client that knew only a session id could drive and close the
victim's session, because the peer looked sessions up by id alone and the client used one id on
every hop of a route.
"""

from __future__ import annotations

import pytest
import torch

from p2pserve.errors import BadRequestError, SessionNotFoundError
from p2pserve.model.spec import load_spec
from p2pserve.model.tiny import build_tiny_model
from p2pserve.peer.kv_cache import KVBudget
from p2pserve.peer.sessions import SessionTable
from p2pserve.protocol import PROTOCOL_VERSION, OpenSession, SamplingParams


@pytest.fixture
def table(tmp_path):
    spec = load_spec(str(build_tiny_model("llama", tmp_path / "tiny", num_layers=2)))
    return SessionTable(spec=spec, served=(0, spec.num_layers), budget=KVBudget(1_000_000), idle_timeout_s=60.0,
                        torch_dtype=torch.float32)


def _open(table, name, owner):
    return table.open(OpenSession(version=PROTOCOL_VERSION, model_id=table.spec.model_id, session_id=name, start=0,
                                  end=table.spec.num_layers, max_length=16, sampling=SamplingParams()), owner=owner)


def test_another_owner_can_neither_get_nor_close_a_session(table):
    alice, mallory = object(), object()
    session = _open(table, "s1", alice)
    free = table.budget.free
    with pytest.raises(SessionNotFoundError) as got:
        table.get("s1", mallory)
    with pytest.raises(SessionNotFoundError) as closed:
        table.close("s1", mallory)
    # Exactly the answer for an id that was never opened: nothing says the session exists.
    with pytest.raises(SessionNotFoundError) as unknown:
        table.get("never-opened", mallory)
    assert str(got.value).replace("s1", "X") == str(unknown.value).replace("never-opened", "X")
    assert str(closed.value).replace("s1", "X") == str(unknown.value).replace("never-opened", "X")
    assert table.get("s1", alice) is session and len(table) == 1 and table.budget.free == free
    table.close("s1", alice)
    assert len(table) == 0
    with pytest.raises(SessionNotFoundError):
        table.get("s1", alice)


def test_reopening_a_taken_id_leaves_the_owner_session_intact(table):
    alice, mallory = object(), object()
    session = _open(table, "s1", alice)
    with pytest.raises(BadRequestError, match="already open"):
        _open(table, "s1", mallory)
    assert table.get("s1", alice) is session
    with pytest.raises(SessionNotFoundError):
        table.get("s1", mallory)
    assert table.close_owned_by(mallory) == 0 and table.get("s1", alice) is session

