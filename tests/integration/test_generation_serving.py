"""Text generation on Ray Serve over real HTTP, with the `openai` client users call it with:
the session's registered pipeline LM (no training here) deployed with `serving.api:
generate`, KV-cache decoding under continuous batching in the replica, speculative: the replica
loads a draft model from the registry, an imperfect one (the same architecture freshly
initialised: near-uniform proposals, mostly rejected), so the rejection path runs on every
request. Every greedy answer below must still equal the model's own cache-free decoding, and
sampled tokens must follow the model's distribution, not the draft's. The plain path is the
README's generation blocks."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import mlflow
import numpy as np
import openai
import pytest
import torch

from raylane.config import load_config
from raylane.config.loader import config_to_yaml
from raylane.models import build_model
from raylane.serving.generation.engine import generate_without_cache
from raylane.serving.generation.loader import load_language_model
from raylane.serving.generation.sampling import SamplingParams
from raylane.tracking.runs import CONFIG_ARTIFACT, log_trained_model

from .conftest import REFERENCE, ROOT, free_port, lm_overrides

pytestmark = pytest.mark.integration

PROMPT = "def __init__(self"
MAX_NUM_SEQS = 4
SPECULATE = 3
DRAFT = "pylm-draft"
DRAFT_SEED = 7


@pytest.fixture(scope="module")
def generator(pipeline_run, workspace):
    from raylane.serving.app import deploy, shutdown_serve

    draft = _register_random_draft(pipeline_run[0], workspace)
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
            f"serving.generation.draft_model=models:/{DRAFT}/1",
        ),
    )
    url, version = deploy(cfg)
    model, _ = load_language_model(workspace.tracking_uri, cfg.tracking.registered_model, version)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        yield url, client, model, cfg, version, draft
    finally:
        shutdown_serve()


def _register_random_draft(served_cfg, workspace):
    """Version 1 of DRAFT: the served model's architecture, freshly initialised (seeded),
    logged with its run's config as a training run logs them. Returns the model."""
    tracking = served_cfg.tracking.model_copy(update={"registered_model": DRAFT})
    cfg = served_cfg.model_copy(update={"tracking": tracking})
    torch.manual_seed(DRAFT_SEED)
    draft = build_model(cfg.model).eval()
    mlflow.set_tracking_uri(workspace.tracking_uri)
    mlflow.set_experiment("generation-draft")
    with mlflow.start_run():
        mlflow.log_text(config_to_yaml(cfg), CONFIG_ARTIFACT)
        log_trained_model(draft, cfg, np.zeros((2, cfg.model.input_dim), dtype=np.int64))
    return draft


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

    def one(index: int, stream: bool = True) -> str:
        request = {"model": "pylm", "prompt": f"x{index} = ", "max_tokens": lengths[index],
                   "temperature": 0.8, "seed": index}  # fmt: skip
        if not stream:
            return client.completions.create(**request).choices[0].text
        chunks = client.completions.create(**request, stream=True)
        return "".join(c.choices[0].text for c in chunks if c.choices)

    results: dict[int, str] = {}
    before = _stats(url)["finished"].get("length", 0)
    threads = [threading.Thread(target=lambda i=i: results.update({i: one(i)})) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert sorted(results) == list(range(16))
    stats = _stats(url)
    assert stats["finished"]["length"] - before == 16  # each ran to its max_tokens
    assert stats["running"] == 0 and stats["free_slots"] == MAX_NUM_SEQS
    # Each seeded request, sent again alone and whole: the same text. Sampling (and the
    # draft's proposals) draw from each request's own generator, whatever ran beside it.
    alone = {i: one(i, stream=False) for i in range(16)}
    assert alone == results


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

    *_, cfg, version, _ = generator
    report = collect_status(cfg)  # once: as `raylane status` does, one event loop per process
    (row,) = [r for r in report.rows if r.deployment == "generator"]
    assert row.versions == {version}
    settings = f"generate: {MAX_NUM_SEQS} slots, draft {DRAFT} v1 proposing {SPECULATE}"
    assert row.settings == {settings}
    import io

    from rich.console import Console

    console = Console(file=io.StringIO(), width=200)
    console.print(render_status(report))
    assert f"v{version} ({settings})" in console.file.getvalue()
    for seed in range(4):  # sampled requests: some of a random draft's proposals accepted
        generator[1].completions.create(
            model="pylm", prompt="x = ", max_tokens=12, temperature=1.0, seed=seed
        )
    stats = _stats(generator[0])
    assert stats["draft_model"] == f"{DRAFT} v1" and stats["speculate"] == SPECULATE
    # A random draft's proposals: some accepted (sampled ones, by chance), most rejected.
    assert 0.0 < stats["acceptance_rate"] < 0.5, stats


def test_sampled_tokens_follow_the_model_not_the_imperfect_draft(generator):
    """400 seeded 3-token completions at temperature 1: the second token is the draft's
    proposal checked by the model (accepted with probability min(1, p/q), else drawn from the
    residual), so its frequencies must be the model's own distribution of that token, not the
    draft's. Compared as total variation distances over the ASCII bytes, the rest pooled."""
    url, client, model, *_, draft = generator
    prompt = list(PROMPT.encode())

    def second(seed: int) -> int | None:
        text = (
            client.completions.create(
                model="pylm", prompt=PROMPT, max_tokens=3, temperature=1.0, seed=seed
            )
            .choices[0]
            .text
        )
        if not text or ord(text[0]) >= 128:  # the first byte not ASCII: not counted
            return None
        return ord(text[1]) if len(text) > 1 and ord(text[1]) < 128 else 128

    with ThreadPoolExecutor(max_workers=MAX_NUM_SEQS) as pool:
        seen = [token for token in pool.map(second, range(400)) if token is not None]
    observed = torch.bincount(torch.tensor(seen), minlength=129).double() / len(seen)

    def second_token(lm) -> torch.Tensor:
        """The second byte's distribution when the model draws the first (an ASCII byte) and
        `lm` the second; bytes >= 128 pooled in the last bin."""
        with torch.no_grad():
            first = torch.softmax(model(torch.tensor([prompt]))[0, -1].double(), -1)[:128]
            rows = torch.tensor([prompt + [b] for b in range(128)])
            nxt = torch.softmax(lm(rows)[:, -1].double(), -1)
        joint = (first[:, None] * nxt).sum(0) / first.sum()
        return torch.cat([joint[:128], joint[128:].sum().reshape(1)])

    def apart(frequencies, distribution) -> float:  # total variation distance
        return 0.5 * (frequencies - distribution).abs().sum().item()

    assert len(seen) >= 300, len(seen)
    expected, proposed = second_token(model), second_token(draft)
    # What sampling alone puts between len(seen) draws and their distribution: its 99.9th
    # percentile over 1,000 seeded simulations is the bound (the same engine in one process,
    # 2,000 samples of a random draft's proposals: at the simulations' median).
    rng = torch.Generator().manual_seed(0)
    simulated = sorted(
        apart(torch.bincount(torch.multinomial(expected, len(seen), True, generator=rng),
                             minlength=129).double() / len(seen), expected)
        for _ in range(1000)
    )  # fmt: skip
    bound = simulated[int(0.999 * len(simulated))]
    found = {"model": apart(observed, expected), "draft": apart(observed, proposed)}
    print(f"total variation: {found}, sampling's 99.9th percentile {bound:.3f}")
    assert found["model"] <= bound and found["draft"] > 2 * bound, (found, bound)


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

    url, client, model, cfg, version, _ = generator
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
