"""``/v1/embeddings`` through the official ``openai`` client: an embedding model served alone,
and beside a generator in one server (``--embedding-model``), under mixed traffic.

References are computed offline before serving, on engines with the same
weights and dtype: vectors must match, and greedy completions must be the
same tokens, whatever the other model's traffic.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from kvserve import LLM, SamplingParams
from kvserve.entrypoints.openai.api_server import build_app
from kvserve.entrypoints.openai.server_config import ServerConfig
from live_server import LiveServer
from model_fixtures import TINY_CHAT_TEMPLATE

pytestmark = pytest.mark.slow

EMBEDDER = "all-minilm-l6-v2"
SENTENCES = [
    "A man is eating food.",
    "The new movie is awesome!",
    "How do I install a Python package without its dependencies?",
    "Café crème, naïve façade.",
    "Retrieval augmented generation combines search with a language model.",
]


def _num_engine_loops() -> int:
    return sum(thread.name == "kvserve-engine" for thread in threading.enumerate())


def _client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    llm = LLM(EMBEDDER, dtype="float32")
    outputs = llm.embed(SENTENCES, use_tqdm=False)
    return {s: np.array(o.outputs.embedding) for s, o in zip(SENTENCES, outputs, strict=True)}


@pytest.fixture(scope="module")
def embedder_server(start_server: Callable[..., LiveServer]) -> LiveServer:
    engine = LLM(EMBEDDER, dtype="float32").llm_engine
    return start_server(build_app(engine, ServerConfig(served_model_name=EMBEDDER)))


def test_openai_client_embeddings(
    embedder_server: LiveServer, reference: dict[str, np.ndarray]
) -> None:
    client = _client(embedder_server)
    # The client asks for base64 by default and decodes it itself.
    response = client.embeddings.create(model=EMBEDDER, input=SENTENCES)
    assert [d.index for d in response.data] == list(range(len(SENTENCES)))
    for sentence, item in zip(SENTENCES, response.data, strict=True):
        assert np.allclose(item.embedding, reference[sentence], atol=1e-6)
    assert response.usage.prompt_tokens == response.usage.total_tokens > len(SENTENCES) * 3
    single = client.embeddings.create(model=EMBEDDER, input=SENTENCES[0], encoding_format="float")
    assert np.allclose(single.data[0].embedding, reference[SENTENCES[0]], atol=1e-6)
    assert single.model == EMBEDDER
    # Without a model: the server's one embedding model.
    reply = httpx.post(f"{embedder_server.url}/v1/embeddings", json={"input": SENTENCES[2]})
    assert reply.status_code == 200, reply.text
    assert np.allclose(reply.json()["data"][0]["embedding"], reference[SENTENCES[2]], atol=1e-6)


def test_token_ids_and_base64_over_raw_http(
    embedder_server: LiveServer, reference: dict[str, np.ndarray]
) -> None:
    tokens = httpx.post(f"{embedder_server.url}/tokenize", json={"prompt": SENTENCES[1]}).json()[
        "tokens"
    ]
    for body_input in (tokens, [tokens, tokens]):
        reply = httpx.post(
            f"{embedder_server.url}/v1/embeddings",
            json={"input": body_input, "encoding_format": "base64"},
        )
        assert reply.status_code == 200, reply.text
        for item in reply.json()["data"]:
            vector = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
            assert np.allclose(vector, reference[SENTENCES[1]], atol=1e-6)


def test_bad_requests_are_400s_naming_the_field(embedder_server: LiveServer) -> None:
    client = _client(embedder_server)
    long_text = " ".join(["token"] * 300)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"input": long_text}, "input"),
        ({"input": "hello", "dimensions": 128}, "dimensions"),
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": [[1, 2], [10**7]]}, "input"),
        ({"input": "hello", "model": "no-such-model"}, "model"),
        ({"input": "hello", "extra_body": {"truncate_prompt_tokens": 0}}, "truncate_prompt_tokens"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            client.embeddings.create(**{"model": EMBEDDER, **kwargs})
        assert refused.value.body["param"] == param, (kwargs, refused.value.body)  # type: ignore[index]
    truncated = client.embeddings.create(
        model=EMBEDDER, input=long_text, extra_body={"truncate_prompt_tokens": 32}
    )
    assert truncated.usage.prompt_tokens == 32
    with pytest.raises(openai.BadRequestError) as generating:
        client.completions.create(model=EMBEDDER, prompt="hello", max_tokens=2)
    assert generating.value.body["param"] == "model"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as chatting:
        client.chat.completions.create(
            model=EMBEDDER, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert chatting.value.body["param"] == "model"  # type: ignore[index]
    assert "embedding model" in chatting.value.body["message"]  # type: ignore[index]


def test_generator_and_embedder_side_by_side(
    tiny_model_dir: Path,
    start_server: Callable[..., LiveServer],
    reference: dict[str, np.ndarray],
) -> None:
    generator = LLM(str(tiny_model_dir), dtype="float32", num_blocks=256, max_model_len=256)
    generator.get_tokenizer().chat_template = TINY_CHAT_TEMPLATE
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = ["a b c", "the cat", "d e f g", "hello"]
    expected = {
        p: o.outputs[0].text
        for p, o in zip(prompts, generator.generate(prompts, greedy), strict=True)
    }
    embedder = LLM(EMBEDDER, dtype="float32").llm_engine
    app = build_app(generator.llm_engine, ServerConfig("tiny"), embedder, EMBEDDER)
    loops_before = _num_engine_loops()
    server = start_server(app)
    # Both engines step on one loop thread (one OpenMP team; their steps take turns).
    assert _num_engine_loops() == loops_before + 1
    client = _client(server)
    assert sorted(m.id for m in client.models.list().data) == sorted(["tiny", EMBEDDER])

    def complete(prompt: str) -> None:
        reply = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert reply.choices[0].text == expected[prompt]

    def embed(sentence: str) -> None:
        reply = client.embeddings.create(model=EMBEDDER, input=[sentence, sentence])
        for item in reply.data:
            assert np.allclose(item.embedding, reference[sentence], atol=1e-6)

    with ThreadPoolExecutor(8) as pool:
        jobs = [pool.submit(complete, p) for p in prompts * 3]
        jobs += [pool.submit(embed, s) for s in SENTENCES * 2]
        for job in jobs:
            job.result()
    with pytest.raises(openai.BadRequestError) as not_embedding:
        client.embeddings.create(model="tiny", input="hello")
    assert not_embedding.value.body["param"] == "model"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as not_generating:
        client.completions.create(model=EMBEDDER, prompt="hello", max_tokens=2)
    assert not_generating.value.body["param"] == "model"  # type: ignore[index]
