"""`n` > 1 in-process (gateway_service/choices.py): the choices' requests (ids, seeds, the fan-out bound), their
usage combined, and the merged stream: chunks as they come with each choice's index, its first chunk with the
role, one message per choice read ahead, the last choice's finish with the usage and [DONE], an error in one
choice ending the stream with the others cancelled, the caller gone cancelling every one."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest
from gateway_fakes import FakeCall, Sent, events, message, payload
from grpc.aio import Metadata

from gateway_service.choices import MAX_FANOUT_BYTES, Choices, choice_requests
from gateway_service.errors import ApiError
from gateway_service.generation import DONE, Generation
from gateway_service.metrics import GatewayMetrics
from gateway_service.requests import parse_chat, parse_completion
from gateway_service.responses import Shaper, usage
from specdec.v1 import executor_pb2

INT64_MAX = 2**63 - 1


def test_each_choice_is_the_request_with_its_own_id_and_seed():
    parsed = parse_completion({"prompt": "x", "n": 3, "seed": INT64_MAX - 1, "temperature": 0.7})
    requests = choice_requests(parsed)
    assert [r.request_id for r in requests] == [f"{parsed.generate.request_id}-{i}" for i in range(3)]
    assert [r.sampling.seed for r in requests] == [INT64_MAX - 1, INT64_MAX, -(2**63)]  # seed + i, wrapped
    assert all(r.text == "x" and r.sampling.temperature == pytest.approx(0.7) for r in requests)
    unseeded = choice_requests(parse_completion({"prompt": "x", "n": 2}))
    assert not any(r.sampling.HasField("seed") for r in unseeded)  # each draws its own


def test_a_batch_of_prompts_is_n_choices_of_each_in_turn():
    parsed = parse_completion({"prompt": ["ab", [5, 6], "c"], "n": 2, "seed": 9, "max_tokens": 3})
    requests = choice_requests(parsed)
    assert parsed.num_choices == 6 and [r.request_id[-2:] for r in requests] == [f"-{i}" for i in range(6)]
    assert [r.text or list(r.token_ids.ids) for r in requests] == ["ab", "ab", [5, 6], [5, 6], "c", "c"]
    assert [r.sampling.seed for r in requests] == [9, 10] * 3  # a prompt's choices: seed + i (vLLM's rule)
    assert all(r.sampling.max_tokens == 3 for r in requests)
    with pytest.raises(ApiError) as err:
        choice_requests(parse_completion({"prompt": ["a"] * 65, "n": 2}))
    assert err.value.param == "prompt" and "130 choices" in err.value.message
    for prompt, param in ((["a"] * 129, "prompt"), ([[]], "prompt[0]"), (["a", 5], "prompt[1]"), ([], "prompt")):
        with pytest.raises(ApiError) as err:
            parse_completion({"prompt": prompt})
        assert err.value.param == param, prompt


def test_the_fan_out_is_bounded_before_it_is_built():
    parsed = parse_completion({"prompt": "x" * (1 << 20), "n": 128})
    with pytest.raises(ApiError) as err:
        choice_requests(parsed)
    assert err.value.status == 400 and err.value.param == "n" and str(MAX_FANOUT_BYTES) in err.value.message
    parsed.n = 8
    assert len(choice_requests(parsed)) == 8  # 8 MiB of copies: allowed


@pytest.mark.parametrize("n", [0, 129, -1, "2", 2.5, True])
def test_n_out_of_range_or_not_an_integer_is_a_400_naming_it(n: Any):
    with pytest.raises(ApiError) as err:
        parse_chat({"messages": [{"role": "user", "content": "hi"}], "n": n})
    assert err.value.status == 400 and err.value.param == "n"


def finished(completion: int, steps: int, accepted: int, rates: list[float]) -> executor_pb2.Finished:
    return executor_pb2.Finished(
        finish_reason="length", prompt_tokens=5, completion_tokens=completion, drafted_tokens=3 * steps,
        accepted_tokens=accepted, verify_steps=steps, mean_acceptance_length=1 + accepted / steps if steps else 1.0,
        acceptance_rate_per_position=rates, cached_prompt_tokens=2,
    )  # fmt: skip


def test_usage_counts_the_prompt_once_and_weighs_acceptance_by_verify_steps():
    a = finished(10, steps=4, accepted=6, rates=[1.0, 0.5])  # accepted per position: 4, 2
    b = finished(7, steps=6, accepted=1, rates=[1 / 6])  # 1 at the first position, none drafted past it
    combined = usage([a, b], per_prompt=2)  # two choices of one prompt
    assert (combined["prompt_tokens"], combined["completion_tokens"], combined["total_tokens"]) == (5, 17, 22)
    assert usage([a, b])["prompt_tokens"] == 10  # two prompts' choices: each prompt counts
    assert combined["prompt_tokens_details"] == {"cached_tokens": 2}
    speculative = combined["speculative"]
    assert (speculative["drafted_tokens"], speculative["accepted_tokens"]) == (30, 7)
    assert speculative["mean_acceptance_length"] == pytest.approx(1 + 7 / 10)
    assert speculative["acceptance_rate_per_position"] == pytest.approx([5 / 10, 2 / 10])
    alone = usage([a])  # one choice: its own figures, as the executor sent them
    assert (alone["completion_tokens"], alone["speculative"]["mean_acceptance_length"]) == (10, 2.5)
    assert alone["speculative"]["acceptance_rate_per_position"] == [1.0, 0.5]


def choices(calls: list[FakeCall], **body: Any) -> tuple[Choices, GatewayMetrics]:
    parsed = parse_chat({"messages": [{"role": "user", "content": "hi"}], "stream": True, "n": len(calls), **body})
    shaper, metrics = Shaper(parsed, "toy"), GatewayMetrics()
    made = [Generation(c, parsed, shaper, metrics, "chat", 0.0) for c in calls]  # type: ignore[arg-type]
    return Choices(made, shaper), metrics


def chunk_choice(body: bytes) -> dict[str, Any]:
    (choice,) = payload(body)["choices"]
    return choice


def test_a_stream_interleaves_the_choices_as_they_come():
    async def run() -> None:
        calls, sent = [FakeCall(), FakeCall()], Sent()
        made, metrics = choices(calls, stream_options={"include_usage": True})
        firsts = [message("a0", [(1, -0.1)]), message("b0", [(2, -0.1)])]
        stream = asyncio.ensure_future(made.stream(firsts, sent))
        opening = [chunk_choice((await sent.next())[0]) for _ in range(2)]  # each choice's first message, in order
        assert [(c["index"], c["delta"]) for c in opening] == [
            (0, {"role": "assistant", "content": "a0"}),
            (1, {"role": "assistant", "content": "b0"}),
        ]
        await asyncio.sleep(0.01)
        assert [c.reads for c in calls] == [1, 1]  # one read ahead per choice, no more
        calls[1].queue.put_nowait(message("b1", [(3, -0.2)]))  # choice 1 runs ahead of choice 0
        assert chunk_choice((await sent.next())[0]) == {
            "index": 1, "delta": {"content": "b1"}, "logprobs": None, "finish_reason": None
        }  # fmt: skip
        last_b = message("b2", [(4, -0.3)], "length")
        last_b.finished.MergeFrom(finished(3, steps=1, accepted=1, rates=[1.0]))
        calls[1].queue.put_nowait(last_b)
        done_b = chunk_choice((await sent.next())[0])
        assert (done_b["index"], done_b["finish_reason"]) == (1, "length")
        last_a = message("a1", [(5, -0.4)], "stop")
        last_a.finished.MergeFrom(finished(2, steps=1, accepted=0, rates=[0.0]))
        last_a.finished.finish_reason = "stop"
        calls[0].queue.put_nowait(last_a)
        body, more = await sent.next()
        chunk, usage_event, done = events(body)  # the last choice's last chunk, the usage and [DONE] together
        assert not more and done == DONE
        assert (chunk_choice(chunk)["index"], chunk_choice(chunk)["finish_reason"]) == (0, "stop")
        counted = payload(usage_event)["usage"]
        assert counted["completion_tokens"] == 5 and counted["speculative"]["mean_acceptance_length"] == 1.5
        await stream
        assert not any(c.cancelled for c in calls)  # every choice ended: nothing to abort
        assert metrics.completion_tokens._value.get() == 5

    asyncio.run(run())


def test_an_error_in_one_choice_ends_the_stream_and_cancels_the_others():
    async def run() -> None:
        calls, sent = [FakeCall(), FakeCall(), FakeCall()], Sent()
        made, metrics = choices(calls)
        stream = asyncio.ensure_future(made.stream([message(f"{i}", [(i, -0.1)]) for i in range(3)], sent))
        for _ in range(3):
            await sent.next()
        failure = grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, Metadata(), Metadata(), "no room")
        calls[1].queue.put_nowait(failure)
        body, more = await sent.next()
        error, done = events(body)
        assert json.loads(error.removeprefix(b"data: "))["error"]["code"] == "resource_exhausted"
        assert done == DONE and not more
        await stream
        assert calls[0].cancelled and calls[2].cancelled  # the others end too
        assert metrics.disconnects._value.get() == 1  # counted once for the request

    asyncio.run(run())


def test_the_caller_gone_cancels_every_choice_and_ends_the_body():
    async def run() -> None:
        calls, sent = [FakeCall(), FakeCall()], Sent()
        made, _ = choices(calls)
        stream = asyncio.ensure_future(made.stream([message("a", [(1, -0.1)]), message("b", [(2, -0.1)])], sent))
        await sent.next()
        await sent.next()
        await asyncio.sleep(0.01)
        made.caller_gone()  # the disconnect watcher's doing
        await stream
        assert all(c.cancelled for c in calls) and sent.bodies[-1] == (b"", False)

    asyncio.run(run())


def test_a_choice_refused_at_its_first_message_cancels_the_others():
    async def run() -> None:
        calls = [FakeCall(), FakeCall()]
        made, _ = choices(calls)
        first = asyncio.ensure_future(made.first())
        calls[0].queue.put_nowait(message("a", [(1, -0.1)]))
        calls[1].queue.put_nowait(grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, Metadata(), Metadata(), "x"))
        with pytest.raises(ApiError) as err:
            await first
        assert err.value.status == 400 and calls[0].cancelled

    asyncio.run(run())


def test_the_whole_answer_lists_every_choice_in_order():
    async def run() -> None:
        calls = [FakeCall(), FakeCall()]
        made, _ = choices(calls, stream=False, logprobs=True)
        for index, call in enumerate(calls):
            last = message(f"-{index}", [(9, -0.9)], "length")
            last.finished.MergeFrom(finished(2, steps=1, accepted=1, rates=[1.0]))
            call.queue.put_nowait(last)
        answer = await made.whole([message("a", [(1, -0.1)]), message("b", [(2, -0.2)])])
        assert [c["index"] for c in answer["choices"]] == [0, 1]
        assert [c["message"]["content"] for c in answer["choices"]] == ["a-0", "b-1"]
        tokens = [[e["token"] for e in c["logprobs"]["content"]] for c in answer["choices"]]
        assert tokens == [["token_id:1", "token_id:9"], ["token_id:2", "token_id:9"]]
        assert answer["usage"]["completion_tokens"] == 4

    asyncio.run(run())
