"""KV-cache decoding and continuous batching against the plain model (no cluster)."""

from __future__ import annotations

import re

import pytest
import torch
from pydantic import ValidationError

from raylane.config.serving import GenerationConfig
from raylane.models.gpt import GPT
from raylane.models.kv_cache import KVCache
from raylane.serving.generation.engine import (
    MAX_MODEL_LEN,
    GenerationEngine,
    generate_without_cache,
)
from raylane.serving.generation.sampling import SamplingParams, sample

CONTEXT = 48


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(256, CONTEXT, 32, 4, 2).eval()


def _prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def test_cached_logits_equal_the_whole_sequence_forward(model):
    cache = KVCache.for_model(model, slots=3)
    a, b = torch.tensor([_prompt(1, 9)]), torch.tensor([_prompt(2, 4)])
    # Prefill two slots with prompts of different lengths (slot 1 stays empty).
    assert torch.allclose(model.extend(a, cache, [2]), model(a), atol=1e-5)
    assert torch.allclose(model.extend(b, cache, [0]), model(b), atol=1e-5)
    # Then three decode steps of both at once, each at its own position.
    for _ in range(3):
        step = torch.tensor([[7], [200]])
        logits = model.extend(step, cache, [0, 2])[:, -1]
        a, b = torch.cat([a, step[1:]], 1), torch.cat([b, step[:1]], 1)
        assert torch.allclose(logits[1], model(a)[0, -1], atol=1e-5)
        assert torch.allclose(logits[0], model(b)[0, -1], atol=1e-5)
    assert cache.lengths == [7, 0, 12]


def test_greedy_continuous_batching_equals_recomputing_every_prefix(model):
    greedy = SamplingParams(max_tokens=20, temperature=0)
    engine = GenerationEngine(model, max_num_seqs=2)  # 5 requests share 2 slots
    prompts = [_prompt(seed, length) for seed, length in enumerate([3, 11, 1, 7, 20])]
    params = [greedy.model_copy(update={"max_tokens": n}) for n in (20, 5, 12, 1, 28)]
    sequences = [engine.add(p, q) for p, q in zip(prompts, params, strict=True)]
    streamed = {s.id: b"" for s in sequences}
    most_running = 0
    while engine.busy:
        for event in engine.step():
            streamed[event.sequence.id] += event.text
        most_running = max(most_running, len(engine.running))
    assert most_running == 2 and sorted(engine.free) == [0, 1]
    for sequence, prompt, param in zip(sequences, prompts, params, strict=True):
        reference = generate_without_cache(model, prompt, param)
        assert sequence.output == reference.output  # token for token
        assert len(sequence.output) == param.max_tokens and sequence.finish_reason == "length"
        assert streamed[sequence.id] == bytes(sequence.output)


def test_a_seeded_request_repeats_and_top_k_1_is_greedy(model):
    engine = GenerationEngine(model, max_num_seqs=4)
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_k=50, top_p=0.9, seed=7)
    first = engine.generate(_prompt(3, 5), seeded).output
    again = engine.generate(_prompt(3, 5), seeded).output
    other = engine.generate(_prompt(3, 5), seeded.model_copy(update={"seed": 8})).output
    assert first == again and first != other
    greedy = engine.generate(_prompt(3, 5), SamplingParams(max_tokens=24, temperature=0)).output
    assert engine.generate(_prompt(3, 5), seeded.model_copy(update={"top_k": 1})).output == greedy


def test_top_p_keeps_the_smallest_set_holding_the_mass():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    params = SamplingParams(temperature=1.0, top_p=0.75)
    drawn = {sample(logits, params, torch.Generator().manual_seed(s)) for s in range(200)}
    assert drawn == {0, 1}  # 0.5 + 0.3 covers 0.75; 2 and 3 are never drawn
    tiny = SamplingParams(temperature=1.0, top_p=0.01)
    assert {sample(logits, tiny, torch.Generator().manual_seed(s)) for s in range(50)} == {0}


def test_a_stop_sequence_ends_the_output_before_it_and_is_never_streamed(model):
    greedy = SamplingParams(max_tokens=30, temperature=0)
    # A prompt whose greedy output holds three ASCII bytes in a row past its start: the stop.
    for seed in range(50):
        prompt = _prompt(seed, 6)
        full = bytes(generate_without_cache(model, prompt, greedy).output)
        ascii_at = [i for i in range(4, 27) if all(b < 128 for b in full[i : i + 3])]
        if ascii_at:
            break
    stop = full[ascii_at[0] : ascii_at[0] + 3].decode()
    engine = GenerationEngine(model, max_num_seqs=1)
    sequence = engine.add(prompt, greedy.model_copy(update={"stop": [stop]}))
    streamed = b""
    while not sequence.finished:
        for event in engine.step():
            streamed += event.text
    cut = full.find(stop.encode())
    assert sequence.finish_reason == "stop" and sequence.text() == full[:cut]
    assert streamed == full[:cut]  # the stop's first bytes were held back, then dropped


def test_an_aborted_request_frees_its_slot_for_the_next(model):
    engine = GenerationEngine(model, max_num_seqs=1)
    long = engine.add(_prompt(5, 4), SamplingParams(max_tokens=40, temperature=0))
    queued = engine.add(_prompt(6, 4), SamplingParams(max_tokens=2, temperature=0))
    engine.step()
    assert long.slot == 0 and queued.slot is None
    engine.abort(long)  # the client went away
    assert engine.free == [0] and long.finish_reason == "abort"
    engine.step()
    assert queued.slot == 0
    while engine.busy:
        engine.step()
    assert len(queued.output) == 2


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "message"),
    [
        ([], 4, "the prompt is empty"),
        ([1, 256], 4, "prompt tokens are bytes: 0-255"),
        ([1] * 40, 9, "prompt (40 tokens) + max_tokens (9) exceeds the model's context of 48"),
    ],
)
def test_requests_that_cannot_run_are_refused_with_the_reason(model, prompt, max_tokens, message):
    engine = GenerationEngine(model, max_num_seqs=1)
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.add(prompt, SamplingParams(max_tokens=max_tokens))
    assert not engine.busy


def test_max_model_len_caps_the_context_and_the_cache(model):
    assert GenerationConfig().max_model_len == MAX_MODEL_LEN  # the config's default is the engine's
    engine = GenerationEngine(model, max_num_seqs=1, max_model_len=16)
    assert engine.context == 16 and GenerationEngine(model, 1, max_model_len=4096).context == 48
    with pytest.raises(ValueError, match=re.escape("prompt (12 tokens) + max_tokens (5) exceeds")):
        engine.add([1] * 12, SamplingParams(max_tokens=5))
    sequence = engine.add([1] * 12, SamplingParams(max_tokens=4))  # exactly 16: it runs
    while engine.busy:
        engine.step()
    assert len(sequence.output) == 4


@pytest.mark.parametrize(
    ("fields", "names"),
    [
        ({"temperature": 3}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": [""]}, "stop sequences must not be empty"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"best_of": 2}, "best_of"),
    ],
)
def test_bad_sampling_fields_are_named(fields, names):
    with pytest.raises(ValidationError, match=names):
        SamplingParams(**fields)


def test_the_cache_refuses_to_pass_the_context(model):
    cache = KVCache.for_model(model, slots=1)
    model.extend(torch.zeros(1, CONTEXT, dtype=torch.long), cache, [0])
    with pytest.raises(ValueError, match="would reach 49 positions; the context holds 48"):
        model.extend(torch.zeros(1, 1, dtype=torch.long), cache, [0])


def test_the_replica_loop_streams_requests_together_and_frees_a_slot_its_reader_left(model):
    import asyncio

    from raylane.serving.generation_loop import GenerationLoop

    async def scenario():
        loop = GenerationLoop(GenerationEngine(model, max_num_seqs=2))
        greedy = SamplingParams(max_tokens=30, temperature=0)
        left = loop.start(_prompt(7, 4), greedy)
        stays = loop.start(_prompt(8, 4), greedy.model_copy(update={"max_tokens": 12}))
        async for _ in loop.events(left):
            break  # the client went away after its first token
        queued = loop.start(_prompt(9, 4), greedy.model_copy(update={"max_tokens": 5}))
        finished = [event async for event in loop.events(stays)]
        rest = [event async for event in loop.events(queued)]
        return left, stays, queued, finished, rest, loop.engine

    left, stays, queued, finished, rest, engine = asyncio.run(scenario())
    assert left.sequence.finish_reason == "abort" and len(left.sequence.output) < 30
    assert b"".join(e.text for e in finished) == bytes(stays.sequence.output)
    assert len(stays.sequence.output) == 12 and len(queued.sequence.output) == 5
    assert rest[-1].finished and sorted(engine.free) == [0, 1] and not engine.busy
    reference = generate_without_cache(model, _prompt(8, 4), stays.params)
    assert stays.sequence.output == reference.output


def test_transformers_gpt2_with_the_same_weights_generates_the_same_tokens(model):
    from raylane.serving.generation.hf_peer import hf_greedy, to_hf_gpt2

    peer = to_hf_gpt2(model)
    prompt = _prompt(10, 6)
    with torch.no_grad():
        ours = model(torch.tensor([prompt]))
        theirs = peer(torch.tensor([prompt])).logits
    assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()
    greedy = SamplingParams(max_tokens=30, temperature=0)
    engine = GenerationEngine(model, max_num_seqs=1)
    assert hf_greedy(peer, prompt, 30) == engine.generate(prompt, greedy).output


def test_speculative_decoding_keeps_greedy_output_and_accepts_repeats(model):
    greedy = SamplingParams(max_tokens=30, temperature=0)
    prompts = [_prompt(seed, 8) * 2 for seed in (11, 12, 13)]  # repeated text: lookups hit
    plain = [generate_without_cache(model, p, greedy).output for p in prompts]
    engine = GenerationEngine(model, max_num_seqs=3, speculate=4)
    sequences = [engine.add(p, greedy) for p in prompts]
    while engine.busy:
        engine.step()
    assert [s.output for s in sequences] == plain
    assert engine.accepted > 0 and engine.proposed >= engine.accepted
    assert engine.forwards < 3 + 30  # fewer forwards than one per token


def test_a_verified_proposal_leaves_the_sampling_distribution_unchanged():
    from raylane.serving.generation.sampling import probabilities, verify

    logits = torch.log(torch.tensor([0.1, 0.6, 0.3]))
    params = SamplingParams(temperature=1.0)
    generator = torch.Generator().manual_seed(0)
    draws = torch.tensor([verify(logits, 2, params, generator)[1] for _ in range(20_000)])
    frequencies = torch.bincount(draws, minlength=3) / len(draws)
    assert torch.allclose(frequencies, probabilities(logits, params), atol=0.015), frequencies


def test_a_draft_model_keeps_greedy_output_and_a_perfect_draft_is_always_accepted(model):
    import copy

    greedy = SamplingParams(max_tokens=27, temperature=0)  # not a whole number of steps
    prompts = [_prompt(seed, 7) for seed in (21, 22, 23)]
    plain = [generate_without_cache(model, p, greedy).output for p in prompts]
    torch.manual_seed(5)
    small = GPT(256, CONTEXT, 16, 2, 1).eval()  # another model: most proposals rejected
    for draft, k in ((small, 3), (copy.deepcopy(model), 4)):
        engine = GenerationEngine(model, max_num_seqs=2, speculate=k, draft=draft)
        sequences = [engine.add(p, greedy) for p in prompts]  # the third waits for a slot
        while engine.busy:
            engine.step()
        assert [s.output for s in sequences] == plain, k
        assert engine.proposed > 0
    # The model's own copy proposes exactly what it would decode: every proposal accepted
    # (and the draft catches up on its last, unread proposal each step).
    assert engine.acceptance_rate == 1.0
    assert engine.forwards <= 3 + 3 * 27 // (k + 1) + 3
    # One stream: the draft reads its unread tokens in its first proposing forward, so a step
    # costs k draft forwards, not k + 1.
    engine = GenerationEngine(model, max_num_seqs=1, speculate=4, draft=copy.deepcopy(model))
    assert engine.generate(prompts[0], greedy).output == plain[0]
    assert engine.draft_forwards == 1 + 4 * (engine.forwards - 1)  # its prefill, then 4 a step
    # Sampled too: a proposal drawn from the model's own distribution is always kept.
    engine = GenerationEngine(model, max_num_seqs=2, speculate=3, draft=copy.deepcopy(model))
    sampled = [SamplingParams(max_tokens=10 + i, temperature=0.8, seed=i) for i in range(3)]
    for prompt, params in zip(prompts, sampled, strict=True):
        engine.add(prompt, params)
    while engine.busy:
        engine.step()
    assert engine.acceptance_rate == 1.0 and engine.proposed > 0


def test_a_draft_sampled_request_repeats_with_its_seed(model):
    torch.manual_seed(6)
    draft = GPT(256, CONTEXT, 16, 2, 1).eval()
    params = SamplingParams(max_tokens=20, temperature=0.9, top_k=40, seed=3)
    runs = [
        GenerationEngine(model, 1, speculate=3, draft=draft).generate(_prompt(4, 5), params).output
        for _ in range(2)
    ]
    assert runs[0] == runs[1] and len(runs[0]) == 20


def test_a_drafted_token_verified_against_its_draft_distribution_keeps_the_target_distribution():
    from raylane.serving.generation.sampling import probabilities, verify

    logits = torch.log(torch.tensor([0.1, 0.6, 0.3]))
    draft = torch.tensor([0.5, 0.2, 0.3])  # far from the target: many corrections
    params = SamplingParams(temperature=1.0)
    generator = torch.Generator().manual_seed(0)
    draws = []
    for _ in range(20_000):
        proposed = int(torch.multinomial(draft, 1, generator=generator))
        draws.append(verify(logits, proposed, params, generator, draft)[1])
    frequencies = torch.bincount(torch.tensor(draws), minlength=3) / len(draws)
    assert torch.allclose(frequencies, probabilities(logits, params), atol=0.015), frequencies


@pytest.mark.parametrize(
    ("draft", "speculate", "message"),
    [
        (GPT(256, CONTEXT, 16, 2, 1), 0, "needs speculate >= 1"),
        (GPT(128, CONTEXT, 16, 2, 1), 2, "vocabulary is 128 tokens, the model's 256"),
        (GPT(256, CONTEXT // 2, 16, 2, 1), 2, r"context \(24 tokens\) is shorter"),
    ],
)
def test_a_draft_that_cannot_propose_is_refused_with_the_reason(model, draft, speculate, message):
    with pytest.raises(ValueError, match=message):
        GenerationEngine(model, 1, speculate=speculate, draft=draft)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"draft_model": "models:/raylane-lm-draft/1"}, "draft_model needs speculate >= 1"),
        ({"draft_model": "raylane-lm-draft", "speculate": 4}, "not models:/NAME/VERSION"),
        ({"draft_model": "models:/raylane-lm-draft/0", "speculate": 4}, "not models:/NAME"),
    ],
)
def test_a_draft_model_setting_is_checked(fields, message):
    from raylane.config.schema import GenerationConfig

    with pytest.raises(ValidationError, match=message):
        GenerationConfig(**fields)
    good = GenerationConfig(draft_model="models:/raylane-lm-draft@champion", speculate=4)
    assert good.draft_model == "models:/raylane-lm-draft@champion"


def test_a_failing_step_fails_the_requests_in_flight_and_the_loop_goes_on(model):
    import asyncio

    from raylane.serving.generation_loop import GenerationLoop

    class Broken(GenerationEngine):
        fail = True

        def step(self):
            if self.fail:
                self.fail = False
                raise MemoryError("out of memory")
            return super().step()

    async def scenario():
        loop = GenerationLoop(Broken(model, max_num_seqs=2))
        greedy = SamplingParams(max_tokens=3, temperature=0)
        doomed = loop.start(_prompt(1, 4), greedy)
        with pytest.raises(RuntimeError, match="generation failed: out of memory"):
            async for _ in loop.events(doomed):
                pass
        after = loop.start(_prompt(2, 4), greedy)
        return [e async for e in loop.events(after)], loop.engine

    events, engine = asyncio.run(scenario())
    assert events[-1].finished and len(events[-1].sequence.output) == 3
    assert sorted(engine.free) == [0, 1]


def test_deploy_refuses_a_registered_draft_whose_recorded_context_is_shorter(tmp_path):
    """Checked on the two versions' recorded configs in a real MLflow store, before deploying:
    a draft of the same context passes, one of a shorter context is named with the reason."""
    from mlflow.tracking import MlflowClient

    from raylane.config import load_config
    from raylane.serving.app import check_draft_model
    from raylane.tracking.runs import CONFIG_ARTIFACT
    from tests.readme_blocks import ROOT

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)  # no fluent API: the process's active run and URI stay as they are
    experiment = client.create_experiment("draft-check")
    base = ROOT / "configs" / "train" / "lm_serve.yaml"

    def register(name: str, *overrides: str) -> None:
        cfg = load_config(base, list(overrides))
        written = tmp_path / name / CONFIG_ARTIFACT
        written.parent.mkdir(parents=True)
        written.write_text(cfg.model_dump_json())  # JSON is YAML
        run_id = client.create_run(experiment).info.run_id
        client.log_artifact(run_id, str(written), artifact_path="config")
        client.set_terminated(run_id)
        if not client.search_registered_models(f"name = '{name}'"):
            client.create_registered_model(name)
        client.create_model_version(name, f"runs:/{run_id}/model", run_id)

    served = load_config(base, ["tracking.tracking_uri=" + uri])
    register(served.tracking.registered_model)
    register("lm-draft-same")
    register("lm-draft-short", f"model.input_dim={served.model.input_dim // 2}")

    def with_draft(name: str):
        return load_config(base, [
            f"tracking.tracking_uri={uri}", "serving.generation.speculate=4",
            f"serving.generation.draft_model=models:/{name}/1",
        ])  # fmt: skip

    check_draft_model(with_draft("lm-draft-same"), uri, 1)
    with pytest.raises(ValueError, match=re.escape(
        f"models:/lm-draft-short/1 (v1) cannot draft for {served.tracking.registered_model} v1: "
        f"the draft's context ({served.model.input_dim // 2} tokens) is shorter"
    )):  # fmt: skip
        check_draft_model(with_draft("lm-draft-short"), uri, 1)
