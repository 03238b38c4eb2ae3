"""`raylane generate`: text from a registered language model, here, without a cluster."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from raylane.cli.common import (
    ConfigOption,
    ServingSetOption,
    VersionOption,
    console,
    fail,
    load,
    setup_logging,
    version_override,
)
from raylane.cli.lazy import deferred
from raylane.cli.running import user_mistakes
from raylane.tracking import resolve_tracking_uri

# torch and MLflow: loaded once the arguments and config are checked.
engine_module = deferred("raylane.serving.generation.engine")
loader = deferred("raylane.serving.generation.loader")
sampling = deferred("raylane.serving.generation.sampling")
serve_app = deferred("raylane.serving.app")
openai_protocol = deferred("raylane.serving.openai_protocol")


def generate(
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="Text to continue.")],
    config: ConfigOption = Path("configs/train/lm_serve.yaml"),
    overrides: ServingSetOption = None,
    version: VersionOption = None,
    max_tokens: Annotated[
        int, typer.Option(help="Tokens to generate at most (bytes for a byte-level GPT).")
    ] = 128,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 0.8,
    top_k: Annotated[int, typer.Option(help="Sample among the k likeliest (0: all).")] = 0,
    top_p: Annotated[float, typer.Option(help="Sample within this probability mass.")] = 1.0,
    seed: Annotated[int | None, typer.Option(help="Seed (repeatable output).")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop before this text.")] = None,
) -> None:
    """Generate text from a registered language model, here (no cluster needed).

    The model runs with its KV cache; the text is printed as it comes.

    Example: raylane generate --prompt 'def main('
    """
    setup_logging()
    cfg = load(config, [*(overrides or []), *version_override(version)])
    try:
        params = sampling.SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            seed=seed, stop=stop or (),
        )  # fmt: skip
    except ValidationError as exc:
        raise fail(openai_protocol.first_error(exc)) from None
    with user_mistakes(ValueError):
        tracking_uri = resolve_tracking_uri(cfg.tracking.tracking_uri)
        served = serve_app.resolve_served_version(cfg, tracking_uri)
        model, card = loader.load_language_model(
            tracking_uri, cfg.tracking.registered_model, served
        )
        generation = cfg.serving.generation
        draft, draft_card = None, None
        if generation.draft_model is not None:
            draft, draft_card = loader.load_draft_model(tracking_uri, generation.draft_model)
        engine = engine_module.GenerationEngine(
            model, 1, speculate=generation.speculate, draft=draft, codec=card.codec,
            draft_codec=draft_card.codec if draft_card is not None else None,
            max_model_len=generation.max_model_len,
        )  # fmt: skip
        sequence = engine.add(card.codec.encode(prompt), params)
    console.print(f"{card.registered_model} v{card.version}, {card.parameters:,} parameters",
                  highlight=False)  # fmt: skip
    text = openai_protocol.TextStream()
    out = sys.stdout
    out.write(prompt)
    while not sequence.finished:
        for event in engine.step():
            out.write(text.feed(event.text, final=event.finished))
            out.flush()
    out.write("\n")
    finish = f"finish: {sequence.finish_reason}, {len(sequence.output)} tokens"
    if engine.acceptance_rate is not None:
        finish += f", {engine.acceptance_rate:.0%} of proposed tokens accepted"
    console.print(finish, highlight=False)
