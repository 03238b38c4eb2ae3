"""Text generation on Ray Serve over real HTTP, with the `openai` client users call it with:
the session's registered pipeline LM (no training here) deployed with `serving.api:
generate`, KV-cache decoding under continuous batching in the replica, speculative: the replica
loads a draft model from the registry (the served version itself, so every greedy proposal is
the model's own next token and must be accepted), and every greedy answer below must still
equal the model's own cache-free decoding. The plain path is the README's generation blocks."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from raylane.config import load_config
from raylane.generation.engine import generate_without_cache
from raylane.generation.loader import load_language_model
from raylane.generation.sampling import SamplingParams

from .conftest import REFERENCE, ROOT, free_port, lm_overrides

pytestmark = pytest.mark.integration

PROMPT = "def __init__(self"
MAX_NUM_SEQS = 4
SPECULATE = 3


@pytest.fixture(scope="module")
def generator(pipeline_run, workspace):
    from raylane.serving.app import deploy, shutdown_serve

    registered = pipeline_run[0].tracking.registered_model
    cfg = load_config(
        ROOT / "configs" / "train" / "lm_pipeline.yaml",
        lm_overrides(
            workspace,
            "serving.api=generate",
            "serving.model_name=pylm",
            f"serving.port={free_port()}",
            f"serving.generation.max_num_seqs={MAX_NUM_SEQS}",
            "serving.max_ongoing_requests=32",
            "serving.autoscaling.max_replicas=1",
            f"serving.generation.speculate={SPECULATE}",
            f"serving.generation.draft_model=models:/{registered}@champion",
        ),
    )
    url, version = deploy(cfg)
    model, _ = load_language_model(workspace.tracking_uri, cfg.tracking.registered_model, version)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        yield url, client, model, cfg, version
    finally:
        shutdown_serve()


def _reference(model, prompt: str, max_tokens: int) -> str:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    output = generate_without_cache(model, list(prompt.encode()), params).output
    return bytes(output).decode("utf-8", errors="replace")


def _stats(url: str) -> dict:
    return httpx.get(f"{url}/v2/models/pylm/stats", timeout=10).json()["model_stats"][0]


def test_completions_streamed_or_not_equal_the_cache_free_reference(generator):
    url, client, model, *_ = generator
    assert [m.id for m in client.models.list().data] == ["pylm"]
    whole = client.completions.create(model="pylm", prompt=PROMPT, max_tokens=24, temperature=0)
    expected = _reference(model, PROMPT, 24)
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(PROMPT.encode())
    assert whole.usage.completion_tokens == 24

    chunks = list(
        client.completions.create(
            model="pylm", prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert len([c for c in chunks if c.choices]) > 1  # it streamed, token by token
    assert chunks[-1].usage.completion_tokens == 24


def test_chat_completions_answer_the_conversation_as_one_prompt(generator):
    _, client, model, *_ = generator
    messages = [{"role": "user", "content": "import os"}]
    reply = client.chat.completions.create(
        model="pylm", messages=messages, max_tokens=16, temperature=0
    )
    expected = _reference(model, "user: import os\nassistant: ", 16)
    assert reply.choices[0].message.content == expected
    stream = client.chat.completions.create(
        model="pylm", messages=messages, max_tokens=16, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected


def test_sixteen_concurrent_streams_complete_through_four_cache_slots(generator):
    url, client, *_ = generator
    lengths = [8 + 3 * i for i in range(16)]
    results: dict[int, str] = {}

    def one(index: int) -> None:
        stream = client.completions.create(
            model="pylm", prompt=f"x{index} = ", max_tokens=lengths[index], temperature=0.8,
            seed=index, stream=True,
        )  # fmt: skip
        results[index] = "".join(c.choices[0].text for c in stream if c.choices)

    before = _stats(url)["finished"].get("length", 0)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert sorted(results) == list(range(16))
    # Byte lengths: a replaced invalid byte is 3 UTF-8 bytes of text, so compare the counts the
    # server finished, and that every stream ended with text.
    assert all(results[i] for i in range(16))
    stats = _stats(url)
    assert stats["finished"]["length"] - before == 16
    assert stats["running"] == 0 and stats["free_slots"] == MAX_NUM_SEQS


def test_a_client_that_disconnects_frees_its_slot(generator):
    url, *_ = generator
    aborted = _stats(url)["finished"].get("abort", 0)
    body = {"model": "pylm", "prompt": "class ", "max_tokens": 56, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # the first event, then hang up
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _stats(url)["finished"].get("abort", 0) == aborted:
        time.sleep(0.05)
    stats = _stats(url)
    assert stats["finished"].get("abort", 0) == aborted + 1, stats
    assert stats["running"] == 0 and stats["free_slots"] == MAX_NUM_SEQS


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("/v1/completions", {"model": "gpt-4", "prompt": "a"}, 404, "'gpt-4' is not served"),
        ("/v1/completions", {"model": "pylm", "prompt": "a" * 60, "max_tokens": 10}, 400,
         "exceeds the model's context of 64 tokens"),
        ("/v1/completions", {"model": "pylm", "prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"model": "pylm", "prompt": "a", "n": 3}, 400, "not supported"),
        ("/v1/chat/completions", {"model": "pylm", "messages": []}, 400, "messages"),
        ("/v1/completions", "not json", 400, "not JSON"),
        ("/v2/models/pylm/generate", {"text_input": ""}, 400, "the prompt is empty"),
    ],
)  # fmt: skip
def test_client_mistakes_get_a_4xx_naming_the_problem(generator, path, body, status, message):
    url, *_ = generator
    content = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    response = httpx.post(f"{url}{path}", content=content, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    text = error["message"] if isinstance(error, dict) else error
    assert message in text, text


def test_the_openai_client_raises_the_servers_message(generator):
    _, client, *_ = generator
    with pytest.raises(openai.BadRequestError, match="exceeds the model's context"):
        client.completions.create(model="pylm", prompt="a" * 63, max_tokens=5)


def test_oip_generate_and_generate_stream(generator):
    url, _, model, *_ = generator
    body = {"text_input": PROMPT, "parameters": {"max_tokens": 12, "temperature": 0}}
    answer = httpx.post(f"{url}/v2/models/pylm/generate", json=body, timeout=30).json()
    assert answer["text_output"] == _reference(model, PROMPT, 12)
    assert answer["finish_reason"] == "length"
    with httpx.stream("POST", f"{url}/v2/models/pylm/generate_stream", json=body) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line]
    assert "".join(e["text_output"] for e in events) == answer["text_output"]
    assert events[-1]["finish_reason"] == "length"


def test_status_shows_the_version_and_generation_settings_served(generator):
    from raylane.serving.status import collect_status, render_status

    *_, cfg, version = generator
    report = collect_status(cfg)  # once: as `raylane status` does, one event loop per process
    (row,) = [r for r in report.rows if r.deployment == "generator"]
    assert row.versions == {version}
    served = f"{cfg.tracking.registered_model} v{version}"
    settings = f"generate: {MAX_NUM_SEQS} slots, draft {served} proposing {SPECULATE}"
    assert row.settings == {settings}
    import io

    from rich.console import Console

    console = Console(file=io.StringIO(), width=200)
    console.print(render_status(report))
    assert f"v{version} ({settings})" in console.file.getvalue()
    stats = _stats(generator[0])
    # The draft is the served model: its proposals are what the model decodes (sampled ones
    # too, up to float rounding between the two caches' batches).
    assert stats["draft_model"] == served and stats["speculate"] == SPECULATE
    assert stats["acceptance_rate"] > 0.99, stats


def test_fuzzed_generation_requests_never_get_a_5xx(generator):
    """Every operation of the generation app's OpenAPI schema (completions, chat, models, OIP
    generate and its stream), fuzzed by schemathesis with requests that fit the schema and
    requests that break it: no 5xx, and every 4xx names its reason in one line."""
    import contextlib

    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis.generation.modes import GenerationMode

    url, *_ = generator
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    posts = {op.path for op in operations if op.method.upper() == "POST"}
    assert {"/v1/completions", "/v1/chat/completions"} <= posts, posts
    calls: list[tuple[str, int]] = []
    faults: list[str] = []

    for operation in operations:
        fixed = {"name": "pylm"} if "{name}" in operation.path else None
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(max_examples=8, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))  # fmt: skip
            @given(case=operation.as_strategy(generation_mode=mode, path_parameters=fixed))
            def check(case):
                response = case.call(base_url=url, timeout=60)
                calls.append((f"{case.method} {case.path}", response.status_code))
                if response.status_code >= 500:
                    faults.append(f"{case.method} {case.formatted_path} -> "
                                  f"{response.status_code}: {response.text[:200]}")  # fmt: skip
                elif response.status_code >= 400:
                    error = response.json().get("error")
                    text = error.get("message") if isinstance(error, dict) else error
                    if not text or "\n" in text:
                        faults.append(f"{case.method} {case.formatted_path}: {response.text}")

            with contextlib.suppress(Unsatisfiable):  # nothing to break in a bare GET
                check()
    assert not faults, faults[:5]
    statuses = {status for _, status in calls}
    assert 200 in statuses and any(400 <= s < 500 for s in statuses), statuses
    assert sum(call.endswith("/completions") for call, _ in calls) >= 16
    stats = _stats(url)
    assert stats["running"] == 0 and stats["free_slots"] == MAX_NUM_SEQS


def test_a_digits_app_serves_beside_it_and_its_removal_leaves_the_lm_serving(
    generator, trained, workspace
):
    """Two raylane applications on one Serve: the digits model (OIP infer) at /digits beside
    the language model at /. A third asking for the language model's prefix is refused before
    anything deploys; `raylane status` reads both; removing the digits app leaves the language
    model answering."""
    import numpy as np
    import pyarrow.parquet as pq

    from raylane.serving.app import ServeConflictError, deploy, running_app_names, undeploy
    from raylane.serving.status import collect_status

    url, client, model, cfg, version = generator
    at_root = [f"serving.port={cfg.serving.port}", "serving.app_name=digits"]
    with pytest.raises(ServeConflictError, match="'/' is held by the running Serve app"):
        deploy(load_config(REFERENCE, workspace.overrides(*at_root)))
    digits = load_config(REFERENCE, workspace.overrides(
        *at_root, "serving.route_prefix=/digits", "serving.autoscaling.max_replicas=1"
    ))  # fmt: skip
    digits_url, digits_version = deploy(digits)
    try:
        assert digits_url == f"{url}/digits" and running_app_names() == {"raylane", "digits"}
        table = pq.read_table(trained[0].data.validation_path).slice(0, 60)
        rows = np.stack(table.column("features").to_numpy(zero_copy_only=False))
        body = {"inputs": [{"name": "features", "shape": list(rows.shape), "datatype": "FP32",
                            "data": rows.reshape(-1).tolist()}]}  # fmt: skip
        answer = httpx.post(f"{digits_url}/v2/models/digits/infer", json=body, timeout=30).json()
        assert answer["model_version"] == str(digits_version), answer
        labels = {o["name"]: o["data"] for o in answer["outputs"]}["label"]
        assert np.mean(np.array(labels) == table.column("label").to_numpy()) >= 0.9
        expected = _reference(model, PROMPT, 8)
        lm = client.completions.create(model="pylm", prompt=PROMPT, max_tokens=8, temperature=0)
        assert lm.choices[0].text == expected
        report = {
            r.app: r for r in collect_status(cfg).rows if r.deployment in ("model", "generator")
        }
        assert (report["digits"].route, report["digits"].versions) == ("/digits", {digits_version})
        assert (report["raylane"].route, report["raylane"].versions) == ("/", {version})
    finally:
        assert undeploy("digits")
    assert running_app_names() == {"raylane"}
    lm = client.completions.create(model="pylm", prompt=PROMPT, max_tokens=8, temperature=0)
    assert lm.choices[0].text == expected
    # /digits/... now falls to the language model's application at /, which has no such route.
    deadline = time.monotonic() + 10
    while (gone := httpx.get(f"{digits_url}/v2/models/digits", timeout=10)).status_code != 404:
        assert time.monotonic() < deadline, gone.text
        time.sleep(0.2)
