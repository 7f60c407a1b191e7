"""GenerateRequest.messages over gRPC: rendered with the model's chat template (tokenizer_config.json here;
GGUF in test_gguf) and tokenized without the tokenizer's own special tokens; refusals by field for a model
without a template, unknown roles, hostile counts and sizes, and a conversation the template refuses."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
from executor_builders import load_request, tiny_config
from greedy_reference import greedy_reference
from rpc_details import violations
from toy_model import toy_tokenizer, write_toy_model

from executor_service.models.chat import MAX_CHAT_BYTES, MAX_CHAT_MESSAGES, load_chat_template
from executor_service.server.main import RunningExecutor
from specdec.v1 import common_pb2, executor_pb2

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")
TEMPLATE = (
    "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('start with a user message') }}{% endif %}"
    "{% for m in messages %}{{ bos_token }}{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}assistant\n{% endif %}"
)


def chat(request_id: str, messages: list[tuple[str, str]], generation_prompt: bool | None = None, **sampling):
    request = executor_pb2.GenerateRequest(request_id=request_id, sampling=executor_pb2.SamplingParams(**sampling))
    request.messages.messages.extend(executor_pb2.ChatMessage(role=r, content=c) for r, c in messages)
    if generation_prompt is not None:
        request.messages.add_generation_prompt = generation_prompt
    request.messages.SetInParent()
    return request


async def refused(stub, request: executor_pb2.GenerateRequest) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        [r async for r in stub.Generate(request)]
    return err.value


async def load(stub, directory: str) -> executor_pb2.LoadModelResponse:
    request = executor_pb2.LoadModelRequest(
        target=executor_pb2.ModelSource(path=directory), dtype=common_pb2.DTYPE_FLOAT32, num_kv_blocks=32
    )
    return await stub.LoadModel(request)


async def test_messages_are_rendered_with_the_models_template(executor: RunningExecutor, stub, tmp_path) -> None:
    write_toy_model(tmp_path / "toy", TEMPLATE)
    loaded = await load(stub, "toy")
    assert loaded.info.has_chat_template and loaded.info.has_tokenizer
    model, tokenizer = executor.servicer.session.loaded.model, toy_tokenizer()
    conversation = [("system", "Be brief"), ("user", "Hi there")]
    for generation_prompt, tail in ((None, "Bassistant\n"), (True, "Bassistant\n"), (False, "")):
        rendered = "Bsystem\nBe briefE\nBuser\nHi thereE\n" + tail
        prompt = tokenizer.encode(rendered, add_special_tokens=False).ids
        responses = [r async for r in stub.Generate(chat("c", conversation, generation_prompt, max_tokens=5))]
        assert [t for r in responses for t in r.token_ids] == greedy_reference(model, prompt, 5)
        assert responses[-1].finished.prompt_tokens == len(prompt)
        assert "".join(r.text for r in responses) == tokenizer.decode([t for r in responses for t in r.token_ids])


async def test_bad_conversations_name_their_fields(executor: RunningExecutor, stub, tmp_path) -> None:
    write_toy_model(tmp_path / "toy", TEMPLATE)
    await load(stub, "toy")
    cases = [
        (chat("a", []), {"messages.messages"}),
        (chat("b", [("user", "hi"), ("tool", "x"), ("", "y"), ("User", "z")]), {
            "messages.messages[1].role", "messages.messages[2].role", "messages.messages[3].role"
        }),
        (chat("c", [("user", "hi")] * (MAX_CHAT_MESSAGES + 1)), {"messages.messages"}),
        (chat("d", [("user", "x" * (MAX_CHAT_BYTES + 1))]), {"messages.messages"}),
        (chat("e", [("r" * 100_000, "hi")]), {"messages.messages[0].role"}),
        (chat("f", [("assistant", "I start")]), {"messages"}),  # the template's raise_exception
    ]  # fmt: skip
    for request, expected in cases:
        err = await refused(stub, request)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, request.request_id
        assert set(violations(err)) == expected, (request.request_id, violations(err))
        assert len(err.details()) < 2000  # contents and roles are not echoed whole
    assert "start with a user message" in violations(err)["messages"]
    ok = [r async for r in stub.Generate(chat("ok", [("user", "hi")], max_tokens=2))]  # still serving
    assert ok[-1].finished.completion_tokens == 2
    assert executor.servicer.session.kv_cache.allocator.num_used == 0


async def test_a_model_without_a_template_refuses_messages(executor: RunningExecutor, stub, tmp_path) -> None:
    write_toy_model(tmp_path / "plain")  # a tokenizer, no chat template
    loaded = await load(stub, "plain")
    assert loaded.info.has_tokenizer and not loaded.info.has_chat_template
    err = await refused(stub, chat("p", [("user", "hi")]))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and set(violations(err)) == {"messages"}
    await stub.LoadModel(load_request())  # synthetic: no tokenizer either
    err = await refused(stub, chat("q", [("user", "hi")]))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "no chat template" in violations(err)["messages"]


def test_where_templates_are_found(tmp_path: Path) -> None:
    tokenizer, config = toy_tokenizer(), tiny_config(bos_token_id=1, eos_token_ids=(2,))
    directory = tmp_path / "named"
    directory.mkdir()
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ bos_token }}D"}]
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    template = load_chat_template(directory, config, tokenizer)
    assert template is not None and template.render([], False) == "bD"  # bos: the tokenizer's token 1
    (directory / "tokenizer_config.json").write_text("{}")
    (directory / "chat_template.jinja").write_text("{{ messages[0]['content'] }}{{ eos_token }}")
    template = load_chat_template(directory, config, tokenizer)
    assert template is not None and template.render([{"role": "user", "content": "x"}]) == "xc"
    (directory / "chat_template.jinja").write_text("{% for %}")  # does not compile: kept with its error
    template = load_chat_template(directory, config, tokenizer)
    assert template is not None and template.compiled is None and "TemplateSyntaxError" in (template.error or "")
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"  # the sandbox refuses Python's internals
    (directory / "chat_template.jinja").write_text(escape)
    template = load_chat_template(directory, config, tokenizer)
    assert template is not None
    with pytest.raises(Exception, match=r"unsafe|not safely"):
        template.render([])
    assert load_chat_template(directory, config, None) is None
