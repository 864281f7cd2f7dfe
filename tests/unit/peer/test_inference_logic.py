"""Pure logic of the inference path: framing, throttling, sampling, text streaming."""

from __future__ import annotations

import pytest
import torch

from p2pserve.client.textstream import IncrementalDetokenizer, StopStringMatcher
from p2pserve.config import BatchingConfig
from p2pserve.errors import MalformedFrameError, PayloadTooLargeError, VersionMismatchError
from p2pserve.peer.batcher import Pending, TokenThrottle
from p2pserve.peer.kv_cache import KVBudget, SequenceCache
from p2pserve.peer.sampling import sample_token
from p2pserve.protocol import (
    PROTOCOL_VERSION,
    FRAME_PREFIX,
    FrameLimits,
    OpenSession,
    SamplingParams,
    TensorMeta,
    check_prefix,
    decode_request,
    encode_frame,
)
from p2pserve.testing import ByteTokenizer
from p2pserve.transport.frames import tensor_from_wire, tensor_to_wire


def test_frame_roundtrip_and_limits():
    msg = OpenSession(version=PROTOCOL_VERSION, model_id="m", session_id="s", start=0, end=2, max_length=8)
    prefix, header, payload = encode_frame(msg)
    assert check_prefix(prefix, FrameLimits()) == (len(header), 0)
    assert decode_request(header) == msg
    with pytest.raises(PayloadTooLargeError):
        check_prefix(FRAME_PREFIX.pack(10, 2**40), FrameLimits())
    with pytest.raises(PayloadTooLargeError):
        check_prefix(FRAME_PREFIX.pack(0, 0), FrameLimits())
    with pytest.raises(MalformedFrameError):
        decode_request(b"\x93\x01\x02")
    with pytest.raises(VersionMismatchError):
        decode_request(encode_frame(OpenSession(version=99, model_id="m", session_id="s", start=0, end=1, max_length=1))[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_tensor_wire_roundtrip(dtype):
    t = (torch.randn(3, 5) * 100).to(dtype)
    meta, data = tensor_to_wire(t)
    assert torch.equal(tensor_from_wire(meta, bytes(data)), t)


def test_tensor_meta_rejects_inconsistent_sizes():
    with pytest.raises(MalformedFrameError):
        TensorMeta("float32", [2, 2], 16).validate(12)
    with pytest.raises(MalformedFrameError):
        TensorMeta("float64", [1], 8).validate(8)
    with pytest.raises(MalformedFrameError):
        TensorMeta("float32", [-1, 4], 16).validate(16)


def test_throttle_follows_gllm_formulas():
    th = TokenThrottle(BatchingConfig(throttle_steps=8, max_prefill_tokens=2048, min_prefill_tokens=32,
                                      kv_threshold=0.05, pipeline_depth=2))
    assert th.prefill_budget(8000, 1.0) == 1000  # WP / T
    assert th.prefill_budget(80000, 0.525) == 1024  # MaxP * (0.525 - 0.05) / 0.95
    assert th.prefill_budget(80000, 0.01) == 32  # never below MinP
    assert th.decode_budget(10) == 5  # RD / depth
    # #RD counts every session decoding through the peer, not only the waiting ones: 16 running at
    # depth 2 make micro-batches of 8, so 10 waiting run 8 and 5 waiting run all 5.
    assert th.decode_budget(10, running=16) == 8
    assert th.decode_budget(5, running=16) == 8
    assert th.micro_batch_full(8, running=16) and not th.micro_batch_full(7, running=16)
    assert not TokenThrottle(BatchingConfig(pipeline_depth=1)).micro_batch_full(16, running=16)


def test_schedule_spreads_decodes_over_the_pipelines_micro_batches():
    th = TokenThrottle(BatchingConfig(pipeline_depth=2))
    waiting = [Pending(f"d{i}", 1, i) for i in range(10)]
    assert [c.pending.key for c in th.schedule(waiting, 1.0, running=16)] == [f"d{i}" for i in range(8)]
    assert len(th.schedule(waiting[:5], 1.0, running=16)) == 5  # fewer than #D wait: all run


def test_schedule_puts_decodes_first_and_chunks_prefill():
    th = TokenThrottle(BatchingConfig(throttle_steps=1, max_prefill_tokens=100, min_prefill_tokens=1, kv_threshold=0.0))
    waiting = [Pending("p1", 150, 0), Pending("d1", 1, 1), Pending("p2", 30, 2), Pending("d2", 1, 3)]
    chunks = th.schedule(waiting, kv_free_fraction=1.0)
    assert [c.pending.key for c in chunks[:2]] == ["d1", "d2"]
    prefill = [(c.pending.key, c.n) for c in chunks[2:]]
    assert prefill == [("p1", 100)]  # budget min(180/1, 100) = 100, FIFO, chunked
    chunks[2].pending.advance(100)
    chunks = th.schedule([waiting[0], waiting[2]], 1.0)
    assert [(c.pending.key, c.offset, c.n) for c in chunks] == [("p1", 100, 50), ("p2", 0, 30)]


def test_background_requests_run_only_in_spare_steps():
    """A witness replay (background) never joins a step with serving work, unless passed over
    ``background_max_skips`` times; alone, it runs at once."""
    th = TokenThrottle(BatchingConfig(throttle_steps=1, min_prefill_tokens=1, kv_threshold=0.0, background_max_skips=2))
    check = Pending("check", 20, 0, background=True)
    decode, prefill = Pending("d1", 1, 1), Pending("p1", 8, 2)
    assert [c.pending.key for c in th.schedule([check, decode, prefill], 1.0)] == ["d1", "p1"]
    assert check.skipped == 1
    assert [c.pending.key for c in th.schedule([check, decode], 1.0)] == ["d1"]
    assert [c.pending.key for c in th.schedule([check, decode], 1.0)] == ["d1", "check"]  # skipped twice: runs
    assert [(c.pending.key, c.n) for c in th.schedule([Pending("c2", 5, 3, background=True)], 1.0)] == [("c2", 5)]


def test_kv_budget_and_cache():
    budget = KVBudget(100)  # whole blocks of 16: 96 token-layers
    assert budget.capacity == 96
    budget.reserve(60)
    with pytest.raises(Exception, match="KV cache full"):
        budget.reserve(60)
    budget.release(60)
    budget.reserve(96)
    cache = SequenceCache(2, 4, num_kv_heads=2, head_dim=4, max_length=40, dtype=torch.float32)
    for _ in range(5):
        k, v = cache.append(2, torch.ones(2, 7, 4), torch.ones(2, 7, 4))
    assert k.shape == (2, 35, 4)
    cache.truncate(10)
    k, _ = cache.append(2, torch.zeros(2, 1, 4), torch.zeros(2, 1, 4))
    assert k.shape == (2, 11, 4) and float(k[:, 10].abs().sum()) == 0


def test_sampling_is_reproducible_per_position():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    assert sample_token(logits, SamplingParams(), 3) == int(logits.argmax())
    p = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=7)
    draws = [sample_token(logits, p, pos) for pos in range(20)]
    assert draws == [sample_token(logits, p, pos) for pos in range(20)]
    assert len(set(draws)) > 1
    allowed = set(torch.topk(logits, 20).indices.tolist())
    assert set(draws) <= allowed


def test_detokenizer_buffers_incomplete_utf8():
    det = IncrementalDetokenizer(ByteTokenizer())
    pieces = [det.push(b) for b in "né€".encode()]
    assert "".join(pieces) == "né€"
    assert "\ufffd" not in "".join(pieces)
    assert pieces[1] == "" and pieces[2] == "é"  # first byte of é alone is held back


def test_stop_strings_are_cut_and_never_leak():
    m = StopStringMatcher(("</end>",))
    out = "".join(m.feed(x) for x in ["Hello </", "en", "d> more"])
    assert out == "Hello " and m.stopped
    m = StopStringMatcher(("STOP",))
    assert m.feed("ST") == "" and m.feed("AR") == "STAR" and m.flush() == ""


def test_open_outside_the_range_is_stale_route_or_bad_request():
    """Layers the model has but this peer does not: a stale route (retriable); beyond the model: bad."""
    from p2pserve.errors import BadRequestError, RangeMovedError
    from p2pserve.model.spec import ModelSpec
    from p2pserve.peer.sessions import SessionTable
    from p2pserve.protocol import PROTOCOL_VERSION, OpenSession, SamplingParams

    spec = ModelSpec(model_id="m", family="llama", hidden_size=8, num_layers=8, num_heads=2, num_kv_heads=2,
                     head_dim=4, intermediate_size=16, vocab_size=16, dtype="float32", tie_word_embeddings=False,
                     max_position_embeddings=64)
    table = SessionTable(spec=spec, served=(5, 8), budget=KVBudget(10_000), idle_timeout_s=60.0,
                         torch_dtype=torch.float32)

    def open_(start, end):
        return table.open(OpenSession(version=PROTOCOL_VERSION, model_id="m", session_id=f"s{start}-{end}", start=start, end=end,
                                      max_length=16, sampling=SamplingParams()), owner=None)

    with pytest.raises(RangeMovedError, match="outside this peer's range"):
        open_(4, 8)
    with pytest.raises(BadRequestError, match="the model has 8 layers"):
        open_(5, 9)
    assert open_(6, 8).start == 6


def test_hidden_states_of_the_wrong_shape_are_blamed_on_the_hop_that_sent_them():
    """The pipeline passes hidden bytes on undecoded, so the client checks them per hop (retriable)."""
    from p2pserve.client.connection import HopConnection
    from p2pserve.client.hop import Hop
    from p2pserve.protocol import ForwardResult, FrameLimits, SessionOpened, TensorMeta

    conn = HopConnection(None, Hop("peerA", 0, 4, ()), FrameLimits(), 5.0)
    conn.session_id = "s"
    conn.opened = SessionOpened(session_id="s", start=0, end=4, served_start=0, served_end=8, hidden_size=8,
                                dtype="float32", peer_version="x")
    good = TensorMeta(dtype="float32", shape=[3, 8], nbytes=96)
    reply = ForwardResult(session_id="s", step=0, position=3, tensor=good)
    assert conn.hidden_of(reply, b"\0" * 96, 3) == good
    wrong = TensorMeta(dtype="float32", shape=[3, 9], nbytes=108)
    with pytest.raises(MalformedFrameError, match=r"expected float32 \[3, 8\]"):
        conn.hidden_of(ForwardResult(session_id="s", step=1, position=6, tensor=wrong), b"\0" * 108, 3)
    lying = TensorMeta(dtype="float32", shape=[3, 8], nbytes=96)
    with pytest.raises(MalformedFrameError):
        conn.hidden_of(ForwardResult(session_id="s", step=1, position=6, tensor=lying), b"\0" * 10, 3)
    token = ForwardResult(session_id="s", step=2, position=9, token=5)
    assert conn.hidden_of(token, b"", 1) is None


def test_generation_params_are_validated_once_and_name_the_bad_field():
    from p2pserve.client.params import GenerationParams
    from p2pserve.errors import BadRequestError

    sampled = GenerationParams.of(max_new_tokens=5, temperature=0.7, stop="END")
    assert sampled.stop == ("END",) and 0 <= sampled.seed < 2**62  # a fixed seed per request: replay is exact
    assert GenerationParams.of().seed == 0
    wire = sampled.validate()
    assert (wire.temperature, wire.top_k, wire.top_p, wire.seed) == (0.7, 0, 1.0, sampled.seed)
    for bad, field in [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=1.5), "max_new_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature="hot"), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(stop=["ok", ""]), "stop"),
    ]:
        params = GenerationParams.of(**bad)
        assert params.problem().field == field, bad
        with pytest.raises(BadRequestError, match=f": {field} "):
            params.validate()


def test_waiting_prompts_are_spread_over_the_pipeline_depth_by_default():
    """#T defaults to the pipeline depth: one peer admits a burst of prompts in one step (up to
    #MaxP), a depth-4 pipeline over four; an explicit throttle_steps still wins."""
    assert TokenThrottle(BatchingConfig()).prefill_budget(1280, 1.0) == 1280
    assert TokenThrottle(BatchingConfig(pipeline_depth=4)).prefill_budget(1280, 1.0) == 320
    assert TokenThrottle(BatchingConfig(throttle_steps=8)).prefill_budget(1280, 1.0) == 160


def test_a_stage_of_several_peers_steps_in_two_micro_batches_by_default():
    """The depth follows what the peer serves unless configured: 1 while it holds every layer
    (its sessions all step at once), 2 while it is one stage of several; the worker tells the
    throttle with each shard it steps."""
    whole, stage = TokenThrottle(BatchingConfig()), TokenThrottle(BatchingConfig(), whole_model=False)
    assert (whole.depth, stage.depth) == (1, 2)
    assert whole.decode_budget(16) == 16 and stage.decode_budget(16) == 8
    assert stage.prefill_budget(1280, 1.0) == 640
    assert TokenThrottle(BatchingConfig(pipeline_depth=1), whole_model=False).depth == 1
    assert TokenThrottle(BatchingConfig(pipeline_depth=3)).depth == 3


def test_the_worker_tells_the_throttle_whether_its_shard_holds_every_layer(tmp_path):
    from p2pserve.model.shard import Shard
    from p2pserve.peer.worker import ComputeWorker
    from tests.harness import tiny_session_table

    path, spec, budget, _ = tiny_session_table(tmp_path / "m")
    throttle = TokenThrottle(BatchingConfig())
    worker = ComputeWorker(Shard.load(path, spec, 0, spec.num_layers), throttle, budget)
    assert throttle.depth == 1
    worker.replace_shard(Shard.load(path, spec, 1, spec.num_layers))
    assert throttle.depth == 2
