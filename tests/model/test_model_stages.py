"""ModelForward runs flush -> stamp -> dispatch -> drafter, with the contract's error rules."""

from __future__ import annotations

import logging

import pytest

from metrale import hookimpl, hookspecs
from metrale.config import EnvironmentConfig, read_environment
from metrale.model.forward import ModelForward
from metrale.model.plugin_manager import MetralePluginManager
from metrale.sequence import MIXED_ADAPTERS, ForwardStep, MixedForwardResult, PrefillSlice, SequenceState


class FakeModel:
    """A model object owned by RecordingFamily."""


class RecordingFamily:
    """Answers every dispatch hook for FakeModel and records what ran, in order."""

    def __init__(self, events, fail=None):
        self.events = events
        self.fail = fail  # method name whose dispatch raises

    def _answer(self, model, method, value):
        if not isinstance(model, FakeModel):
            return None
        self.events.append(f"dispatch:{method}")
        if self.fail == method:
            raise RuntimeError(f"injected failure in {method}")
        return value

    @hookimpl
    def metrale_prefill(self, model, tokens, seq, stream):
        return self._answer(model, "prefill", "logits")

    @hookimpl
    def metrale_prefill_chunk(self, model, tokens, seq, chunk_start, chunk_len, is_last_chunk, stream):
        if isinstance(model, FakeModel) and not is_last_chunk:
            self.events.append("dispatch:prefill_chunk")
            return None
        return self._answer(model, "prefill_chunk", "logits")

    @hookimpl
    def metrale_prefill_twophase(self, model, tokens, seq, chunk_size, stream):
        return self._answer(model, "prefill_twophase", "logits")

    @hookimpl
    def metrale_decode(self, model, token, seq, stream):
        return self._answer(model, "decode", "logits")

    @hookimpl
    def metrale_decode_batch(self, model, tokens, seqs, stream):
        return self._answer(model, "decode_batch", "logits")

    @hookimpl
    def metrale_mixed_forward(self, model, decode_tokens, decode_seqs, prefill_tokens, prefill_seq, chunk_start,
                              chunk_len, is_last, stream):
        return self._answer(model, "mixed_forward", MixedForwardResult("d", "p" if is_last else None))

    @hookimpl
    def metrale_prefill_batch_chunk(self, model, slices, stream):
        return self._answer(model, "prefill_batch_chunk", ["logits"] * len(slices))

    @hookimpl
    def metrale_prefill_batch_chunk_rows(self, model, slices, stream, row_base):
        return self._answer(model, "prefill_batch_chunk_rows", ["logits"] * len(slices))

    @hookimpl
    def metrale_score(self, model, tokens, seq, stream):
        return self._answer(model, "score", "all-logits")


class RecordingStages:
    def __init__(self, events, drafter_error=None, stamp_error=None, end_capture_error=None):
        self.events = events
        self.drafter_error = drafter_error
        self.stamp_error = stamp_error
        self.end_capture_error = end_capture_error
        self.capture_errors = []

    @hookimpl
    def metrale_flush(self, model, step):
        self.events.append("flush")

    @hookimpl
    def metrale_stamp(self, model, step):
        self.events.append("stamp")
        if self.stamp_error:
            raise self.stamp_error

    @hookimpl
    def metrale_drafter(self, model, step, result):
        self.events.append("drafter")
        if self.drafter_error:
            raise self.drafter_error

    @hookimpl
    def metrale_end_graph_capture(self, model, step, error):
        self.events.append("end_graph_capture")
        self.capture_errors.append(error)
        if self.end_capture_error:
            raise self.end_capture_error


def make_forward(events, environment=None, fail=None, **stage_options):
    manager = MetralePluginManager()
    manager.add_hookspecs(hookspecs)
    manager.register(RecordingFamily(events, fail=fail), name="family")
    stages = RecordingStages(events, **stage_options)
    manager.register(stages, name="stages")
    return ModelForward(FakeModel(), manager, environment or EnvironmentConfig()), stages


def seq(n=4):
    return SequenceState.from_prompt(list(range(n)))


def call(forward, method):
    s = seq()
    calls = {
        "prefill": lambda: forward.prefill(s.tokens, s),
        "prefill_chunk_last": lambda: forward.prefill_chunk(s.tokens, s, 0, 4, True),
        "prefill_chunk_not_last": lambda: forward.prefill_chunk(s.tokens, s, 0, 2, False),
        "prefill_twophase": lambda: forward.prefill_twophase(s.tokens, s, 2),
        "decode": lambda: forward.decode(1, s),
        "decode_batch": lambda: forward.decode_batch([1, 2], [s, seq()]),
        "mixed_forward_last": lambda: forward.mixed_forward([1], [seq()], s.tokens, s, 0, 4, True),
        "mixed_forward_not_last": lambda: forward.mixed_forward([1], [seq()], s.tokens, s, 0, 2, False),
        "prefill_batch_chunk": lambda: forward.prefill_batch_chunk([PrefillSlice(s.tokens, s, 0, 4, True)]),
        "prefill_batch_chunk_rows": lambda: forward.prefill_batch_chunk_rows([PrefillSlice(s.tokens, s, 0, 4, True)], None, 3),
        "score": lambda: forward.score(s.tokens, s),
    }
    return calls[method]()


DISPATCHED = {
    "prefill_chunk_last": "prefill_chunk", "prefill_chunk_not_last": "prefill_chunk",
    "mixed_forward_last": "mixed_forward", "mixed_forward_not_last": "mixed_forward",
}
RUNS_DRAFTER = {"prefill", "prefill_chunk_last", "prefill_twophase", "mixed_forward_last"}
ALL_CALLS = [
    "prefill", "prefill_chunk_last", "prefill_chunk_not_last", "prefill_twophase", "decode", "decode_batch",
    "mixed_forward_last", "mixed_forward_not_last", "prefill_batch_chunk", "prefill_batch_chunk_rows", "score",
]


@pytest.mark.parametrize("method", ALL_CALLS)
def test_stage_order_for_every_method(method):
    events = []
    forward, _ = make_forward(events)
    call(forward, method)
    expected = ["flush", "stamp", f"dispatch:{DISPATCHED.get(method, method)}"]
    if method in RUNS_DRAFTER:
        expected.append("drafter")
    assert events == expected


@pytest.mark.parametrize("method", sorted(RUNS_DRAFTER))
def test_environment_variable_turns_the_drafter_off(method):
    events = []
    environment = read_environment({"METRALE_NO_MTP_EAGER_DRAFTER": "1"})
    forward, _ = make_forward(events, environment=environment)
    call(forward, method)
    assert "drafter" not in events
    assert events[-1].startswith("dispatch:")


def test_failing_drafter_never_fails_the_call(caplog):
    events = []
    forward, _ = make_forward(events, drafter_error=RuntimeError("drafter broke"))
    with caplog.at_level(logging.WARNING, logger="metrale.model.forward"):
        assert forward.prefill([1, 2, 3], seq(3)) == "logits"
    assert events == ["flush", "stamp", "dispatch:prefill", "drafter"]
    assert "drafter failed" in caplog.text


@pytest.mark.parametrize("method", sorted(RUNS_DRAFTER))
def test_raising_dispatch_skips_the_drafter(method):
    events = []
    forward, stages = make_forward(events, fail=DISPATCHED.get(method, method))
    with pytest.raises(RuntimeError, match="injected failure"):
        call(forward, method)
    assert "drafter" not in events
    assert ("end_graph_capture" in events) == (method == "mixed_forward_last")


@pytest.mark.parametrize("method", ["decode_batch", "mixed_forward_last", "mixed_forward_not_last"])
def test_batched_errors_end_the_graph_capture_before_propagating(method):
    events = []
    dispatched = DISPATCHED.get(method, method)
    forward, stages = make_forward(events, fail=dispatched)
    with pytest.raises(RuntimeError, match="injected failure") as raised:
        call(forward, method)
    assert events == ["flush", "stamp", f"dispatch:{dispatched}", "end_graph_capture"]
    assert stages.capture_errors == [raised.value]


def test_failing_capture_end_keeps_the_original_error():
    events = []
    forward, _ = make_forward(events, fail="decode_batch", end_capture_error=ValueError("capture end broke"))
    with pytest.raises(RuntimeError, match="injected failure"):
        call(forward, "decode_batch")
    assert events[-1] == "end_graph_capture"


def test_refusing_stamp_prevents_the_dispatch():
    events = []
    forward, _ = make_forward(events, stamp_error=PermissionError("adapter route refused"))
    with pytest.raises(PermissionError):
        call(forward, "decode_batch")
    assert events == ["flush", "stamp"]


def test_builtin_stamp_records_the_adapter_route():
    from metrale.plugins import stages

    def stamped(method, slots):
        seqs = [SequenceState.from_prompt([1], adapter_slot=slot) for slot in slots]
        step = ForwardStep(method, seqs)
        stages.metrale_stamp(model=None, step=step)
        return step.stamps["adapter_route"]

    assert stamped("decode_batch", [3, 3]) == 3
    assert stamped("decode_batch", [None, None]) is None
    assert stamped("decode_batch", [1, 2]) == MIXED_ADAPTERS
    assert stamped("decode_batch", [None, 2]) == MIXED_ADAPTERS  # base-model rows beside adapter rows
    # A mixed step of one adapter takes the single-adapter route: its kernels read every row's
    # slot, so token overlays apply there too.
    assert stamped("mixed_forward", [1, 1]) == 1


def test_builtin_stamp_refuses_adapters_the_model_does_not_hold():
    from metrale.errors import AdapterError
    from metrale.model.family import FamilyModel
    from metrale.plugins import stages

    model = FamilyModel.__new__(FamilyModel)
    model.lora_layout = None
    step = ForwardStep("decode_batch", [SequenceState.from_prompt([1], adapter_slot=2)])
    with pytest.raises(AdapterError, match="LoRA is not enabled"):
        stages.metrale_stamp(model=model, step=step)
    base = ForwardStep("decode_batch", [SequenceState.from_prompt([1])])
    stages.metrale_stamp(model=model, step=base)  # the base model needs no adapters
    assert base.stamps["adapter_route"] is None


def test_builtin_capture_hook_ends_the_backend_capture():
    from metrale.plugins import stages

    class Backend:
        ended = []

        def end_graph_capture(self, stream):
            self.ended.append(stream)

    class Model:
        backend = Backend()

    stages.metrale_end_graph_capture(model=Model(), step=ForwardStep("decode_batch", [], stream="s0"), error=None)
    assert Backend.ended == ["s0"]
