"""The runnable blocks of README.md and the documentation site (docs/**/*.md), executed as
written from a fresh copy.

Blocks share one copy (data prepared, models registered, the MLflow store), as they would for
a person reading from the start. A block that appears word for word in two places (README.md
and the guide it summarises) is run once, for both. The only changes to the text are the
documented placeholders (`<run>`, `<old>`, `<new>`). Servers (`raylane deploy`, `serve run`,
`mlflow ui`) are started, used and stopped with Ctrl-C; clusters a block starts are stopped even
when it fails.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import re
import signal
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from raylane.config import load_config
from raylane.serving.ingress import DRAIN_ENV, LOCAL_DRAIN_S
from raylane.tracking.identity import code_digest
from tests.readme_blocks import Block, read_blocks

from .conftest import free_port
from .readme_runner import Background, BlockRun, clean_env, fresh_copy, run_block, run_commands

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUN = [b for b in read_blocks() if b.mode == "run"]
CLAIMED: list[Block] = []
RAY_INTERNALS = ("TrainController", "RayTrainWorker", "SplitCoordinator", "TrainingReport")
ENDPOINT = "http://127.0.0.1:8000"


def block(command: str) -> Block:
    """The one runnable block, across README.md and docs/, with a command starting with
    `command` (identical copies of it in other files are claimed with it)."""
    found = [b for b in RUN if any(c.startswith(command) for c in b.commands())]
    texts = {b.text for b in found}
    assert len(texts) == 1, (
        f"{len(texts)} different runnable blocks with {command!r}: {[b.where for b in found]}"
    )
    CLAIMED.extend(found)
    return found[0]


COMMAND_LINE = block("raylane prepare  --config configs/train/digits_ddp.yaml")
PIPELINES = block("raylane train --config configs/train/lm_pipeline.yaml")
SHARDED = block("raylane train --config configs/train/lm_tp.yaml")
CONTEXT = block("raylane train --config configs/train/lm_long.yaml")
CONSISTENCY = block("raylane train --config configs/train/digits_ddp.yaml --set parallelism")
TUNE = block("raylane tune")
PLAN = block("raylane plan --config configs/plan/gpt_1p3b.yaml")
PLAN_LLAMA = block("raylane plan --config configs/plan/llama3_8b.yaml")
MLFLOW_UI = block(".venv/bin/mlflow ui")
REPRODUCE = block("raylane reproduce <run-id>")
DEPLOY = block("raylane deploy --config configs/train/digits_ddp.yaml")
CALLS = block("curl -s http://127.0.0.1:8000/v2/models/digits/infer")
TRITON = block("import numpy as np, tritonclient")
SERVE_RUN = block("serve run serving/config.yaml")
ROLLING = block("raylane promote <old>")
GENERATE = block("raylane train --config configs/train/lm_serve.yaml")
GENERATE_DEPLOY = block("raylane deploy --config configs/train/lm_serve.yaml")
FINETUNE = block("raylane finetune --config configs/finetune/lm_lora.yaml")
OPENAI_CLIENT = block("for chunk in client.completions.create(")
ADAPTERS_CLIENT = block('for model in ["pylm", "pylm:raylane-lm-lora/1"')
JOBS = block("ray job submit")
YOUR_MODEL = block("python tools/tiny_checkpoint.py")
YOUR_MODEL_DEPLOY = block("raylane deploy --detach --config configs/finetune/llama_lora.yaml")
YOUR_MODEL_CHAT = block("for chunk in client.chat.completions.create(")
YOUR_MODEL_STOP = block("raylane undeploy --config configs/finetune/llama_lora.yaml")
CUSTOM_MODEL = block("raylane train --config configs/train/digits_custom.yaml")
DATA_TEXT = block(
    "raylane prepare --config examples/data/lm.yaml --set 'data.files=[examples/data/notes"
)
DATA_JSONL = block(
    "raylane prepare --config examples/data/lm.yaml --set 'data.files=[examples/data/text.jsonl]'"
)
DATA_TABLES = block("raylane prepare --config examples/data/table.yaml")
DATA_BAD_ROW = block(
    "raylane prepare --config examples/data/lm.yaml --set 'data.files=[examples/data/bad_row"
)


def test_every_runnable_block_is_run_here():
    unclaimed = [b.where for b in RUN if b not in CLAIMED]
    assert not unclaimed, f"runnable blocks no test runs: {unclaimed}"


@pytest.fixture(scope="module")
def readme(tmp_path_factory):
    root = tmp_path_factory.mktemp("readme")
    copy = fresh_copy(root / "raylane")
    env = clean_env(copy, root / "home")
    env["COLUMNS"] = "200"  # a wide terminal: tables keep paths on one line
    # The blocks' own `ray start` clusters have no load balancer in front of HAProxy: their
    # stopping replicas drain in 2 s, as on the session cluster and a Ray raylane starts itself
    # (a user's own value wins, as here; Serve's default is 30 s per rolling update).
    env[DRAIN_ENV] = LOCAL_DRAIN_S
    return copy, env, root


def _ok(run: BlockRun, what: str) -> BlockRun:
    assert run.returncode == 0, f"{what} failed (exit {run.returncode}):\n{run.output[-6000:]}"
    return run


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as answer:
        assert answer.status == 200
        return json.loads(answer.read())


def _post_json(url: str, body: dict) -> dict:
    headers = {"content-type": "application/json"}
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())


def _port_closed(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def _ray_stop(copy, env) -> None:
    from raylane.serving.leftovers import stop_leftover_ingress

    subprocess.run(["ray", "stop", "--force"], cwd=copy, env=env, capture_output=True, timeout=120)
    stop_leftover_ingress(None)  # `ray stop` leaves Serve's HAProxy running, orphaned


def test_command_line_block(readme):
    copy, env, _ = readme
    run = _ok(run_block(COMMAND_LINE, copy, env, timeout_s=900), COMMAND_LINE.where)

    train = run.command("raylane train").lines
    assert any("epoch 3/3" in line and "val_accuracy" in line for line in train), train
    assert not [line for line in train if any(m in line for m in RAY_INTERNALS)], train
    assert not [line for line in train if "Warning" in line], train
    assert len(train) <= 30, "\n".join(train)
    assert "raylane-digits@champion -> v1" in run.command("raylane promote 1").output
    assert run.left == []  # train and the quickstart stop every process they started

    quickstart = run.command("raylane quickstart").output
    correct, total = map(int, re.search(r"(\d+)/(\d+) correct", quickstart).groups())
    assert total == 10 and correct >= 7, quickstart  # 10 rows; chance is 1 in 10
    assert (copy / "mlflow.db").is_file() and (copy / "data" / "digits").is_dir()
    # The quickstart's 10-epoch model beats the 3-epoch v1: the champion alias moved to it.
    client = MlflowClient(tracking_uri=f"sqlite:///{copy}/mlflow.db")
    champion = client.get_model_version_by_alias("raylane-digits", "champion")
    first = client.get_model_version("raylane-digits", "1")
    assert int(champion.version) == 2, champion.version
    scores = [client.get_run(v.run_id).data.metrics["val_accuracy"] for v in (first, champion)]
    assert scores[1] > scores[0], scores


@pytest.fixture(scope="class")
def on_cluster(readme):
    """A `ray start` cluster, as a user's would be, for the blocks that do not test a local
    start: their commands reach it through RAY_ADDRESS (with the token, RAY_AUTH_MODE=token)
    instead of each starting and stopping a Ray of its own. Stopped at the end of the class,
    before the blocks that start Ray themselves."""
    copy, env, root = readme
    cluster_env = {**env, "RAY_AUTH_MODE": "token"}
    port = free_port()
    ports = [f"--dashboard-port={free_port()}", f"--ray-client-server-port={free_port()}"]
    run = {"cwd": copy, "env": cluster_env, "capture_output": True, "timeout": 120}
    subprocess.run(["ray", "get-auth-token", "--generate"], check=True, **run)
    subprocess.run(
        ["ray", "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
         "--dashboard-host=127.0.0.1", *ports, "--disable-usage-stats"],
        check=True, **run,
    )  # fmt: skip
    try:
        yield copy, {**cluster_env, "RAY_ADDRESS": f"127.0.0.1:{port}"}, root
    finally:
        _ray_stop(copy, cluster_env)


class TestOnARunningCluster:
    def test_pipeline_block(self, on_cluster):
        copy, env, _ = on_cluster

        def fill(command: str, done) -> str:
            if "<run>" not in command:
                return command
            first = done[0].output  # the GPipe run: same layout as the resumed one
            run_dir = re.search(r"runs/([^/\s]+)/epoch_0000", first).group(1)
            return command.replace("<run>", run_dir)

        run = _ok(run_commands(PIPELINES, copy, env, timeout_s=1200, fill=fill), PIPELINES.where)
        client = MlflowClient(tracking_uri=f"sqlite:///{copy}/mlflow.db")
        for command in run.commands:
            # Each command's last epoch line shows the validation loss its run recorded.
            shown = re.findall(r"val_loss (\d+\.\d{4})", command.output)
            run_id = re.search(r"MLflow run ([0-9a-f]{32})", command.output).group(1)
            recorded = client.get_run(run_id).data.metrics["val_loss"]
            assert shown and shown[-1] == f"{recorded:.4f}", (shown, recorded, command.output)
        resumed = run.commands[-1].output
        assert "epoch 2/2" in resumed and "epoch 1/2" not in resumed, resumed
        # Epoch 1 came from the stages' checkpoint parts; only epoch 2 was trained.
        run_id = re.search(r"MLflow run ([0-9a-f]{32})", resumed).group(1)
        resumed_loss = client.get_metric_history(run_id, "train_loss")
        assert [m.step for m in resumed_loss] == [1]
        # It went on from the checkpoint's weights: below the first epoch's loss from scratch.
        first = re.search(r"MLflow run ([0-9a-f]{32})", run.commands[0].output).group(1)
        assert resumed_loss[0].value < client.get_run(first).data.metrics["train_loss"]

        # The hybrid run: 4 workers as dp=2 replicas of a 2-stage pipeline, and it learned.
        hybrid = re.search(r"MLflow run ([0-9a-f]{32})", run.commands[1].output).group(1)
        snapshot_path = client.download_artifacts(hybrid, "cluster/snapshot.json")
        snapshot = json.loads(Path(snapshot_path).read_text())
        assert (snapshot["run"]["dp"], snapshot["run"]["pp"], snapshot["run"]["workers"]) == (
            2,
            2,
            4,
        )
        assert client.get_run(hybrid).data.metrics["val_loss"] < math.log(256)
        layout = Path(client.download_artifacts(hybrid, "parallel/stage_layout.txt")).read_text()
        assert "(x2 replicas)" in layout

    def test_sharded_block(self, on_cluster):
        copy, env, _ = on_cluster
        run = _ok(run_block(SHARDED, copy, env, timeout_s=900), SHARDED.where)
        client = MlflowClient(tracking_uri=f"sqlite:///{copy}/mlflow.db")
        for command, experiment, workers in zip(
            run.commands, ("lm-tp", "lm-fsdp"), (2, 2), strict=True
        ):
            run_id = re.search(r"MLflow run ([0-9a-f]{32})", command.output).group(1)
            found = client.get_run(run_id)
            assert (
                found.info.experiment_id == client.get_experiment_by_name(experiment).experiment_id
            )
            assert found.data.params["parallelism.workers"] == str(workers)
            assert found.data.metrics["val_loss"] < math.log(256)  # better than a uniform guess
            config = copy / "configs" / "train" / f"{experiment.replace('-', '_')}.yaml"
            held = _split_parameters(config)
            assert found.data.metrics["worker_param_mb"] == pytest.approx(held * 4 / 2**20)
            # The summary table's row: "checkpoint │ <path>/epoch_NNNN".
            checkpoint = copy / re.findall(r"checkpoint[\s│]+(\S+epoch_\d{4})", command.output)[-1]
            assert (checkpoint / "sharded" / ".metadata").is_file(), checkpoint

    def test_context_parallel_block(self, on_cluster):
        copy, env, _ = on_cluster
        run = _ok(run_block(CONTEXT, copy, env, timeout_s=900), CONTEXT.where)
        output = run.commands[0].output
        found = MlflowClient(tracking_uri=f"sqlite:///{copy}/mlflow.db").get_run(
            re.search(r"MLflow run ([0-9a-f]{32})", output).group(1)
        )
        assert found.data.params["layout.cp"] == "2"
        assert found.data.params["model.input_dim"] == "2048"
        assert found.data.metrics["val_loss"] < math.log(256)  # better than a uniform guess
        checkpoint = copy / re.findall(r"checkpoint[\s│]+(\S+epoch_\d{4})", output)[-1]
        assert (checkpoint / "model-part000.pt").is_file(), checkpoint  # the whole model

    def test_consistency_block(self, on_cluster):
        copy, env, _ = on_cluster
        run = _ok(run_block(CONSISTENCY, copy, env, timeout_s=600), CONSISTENCY.where)
        output = run.commands[0].output
        assert "epoch 2/2" in output, output
        run_id = re.search(r"MLflow run ([0-9a-f]{32})", output).group(1)
        client = MlflowClient(tracking_uri=f"sqlite:///{copy}/mlflow.db")
        metrics = client.get_run(run_id).data.metrics
        assert client.get_run(run_id).data.params["parallelism.strategy"] == "ssp"
        # The stragglers slept, updates were stale, yet no more than ssp allows (2 workers, s=2).
        assert metrics["step_straggler_ms"] > 0 and metrics["step_split_error"] < 0.2, metrics
        assert 0 < metrics["staleness_max"] <= 5, metrics
        assert metrics["val_accuracy"] > 0.5, metrics  # chance is 0.1
        artifacts = {a.path for a in client.list_artifacts(run_id)}
        assert {"staleness_histogram.json", "step_time_split.png"} <= artifacts, artifacts

    def test_tune_block(self, on_cluster):
        copy, env, _ = on_cluster
        run = _ok(run_block(TUNE, copy, env, timeout_s=1200), TUNE.where)
        best = copy / "configs" / "generated" / "lm-parallelism-best.yaml"
        cfg = load_config(best)  # the winner is a valid, runnable training config
        assert cfg.training.steps_per_epoch is None  # a full run, not the trial's short epochs
        with (copy / "configs" / "generated" / "lm-parallelism-trials.csv").open() as handle:
            winner = next(csv.DictReader(handle))
        # The config written is the layout ranked first.
        assert cfg.parallelism.strategy == winner["strategy"], (cfg.parallelism, winner)
        assert cfg.parallelism.workers == int(winner["workers"]), (cfg.parallelism, winner)
        assert winner["status"] == "ok" and float(winner["samples_per_s"]) > 0
        # The console names that layout, its throughput and the config written for it.
        said = re.search(
            r"winner: (\S+) at (\d+\.\d) samples/s -> \S*lm-parallelism-best\.yaml",
            " ".join(run.output.split()),
        )
        assert said, run.output[-4000:]
        assert said[1] == winner["layout"] and said[2] == f"{float(winner['samples_per_s']):.1f}"
        # The winner learned in its few trial steps: well below a uniform guess over 256 bytes.
        assert float(winner["train_loss"]) < 0.8 * math.log(256), winner
        # One line per trial event, not Tune's status tables with every trial's config.
        assert "Trial status:" not in run.output and "'config': {" not in run.output
        # 5 valid layouts: at most the 3 predicted fastest measured, the rest predicted only.
        with (copy / "configs" / "generated" / "lm-parallelism-trials.csv").open() as handle:
            statuses = [
                row["status"] for row in csv.DictReader(handle) if row["status"] != "pruned"
            ]
        assert len(statuses) == 5 and 2 <= statuses.count("not run") <= 4, statuses
        tune_output = " ".join(run.command("raylane tune").output.split())  # lines wrap
        used = re.search(r"predictions: profile run ([0-9a-f]{32}), step work x[\d.]+", tune_output)
        assert used, tune_output[-3000:]

        # The search's profile shown on its own: the run the search measured, read back.
        profile = run.command("raylane profile").output
        assert "one block, forward + backward" in profile and "all-reduce" in profile, profile
        assert "(reused)" in profile and f"MLflow run {used[1]}" in profile, profile

    def test_reproducibility_block(self, on_cluster):
        copy, env, _ = on_cluster

        def fill(command: str, done) -> str:
            if "<run-id>" in command:
                run_id = re.search(r"MLflow run ([0-9a-f]{32})", done[0].output).group(1)
                command = command.replace("<run-id>", run_id)
            if "<other-run-id>" in command:
                again = re.search(r"\(run ([0-9a-f]{32}) reproduces", done[1].output).group(1)
                command = command.replace("<other-run-id>", again)
            return command

        run = _ok(run_commands(REPRODUCE, copy, env, timeout_s=900, fill=fill), REPRODUCE.where)
        reproduce, compare = run.commands[1].output, run.commands[2].output
        original = re.search(r"MLflow run ([0-9a-f]{32})", run.commands[0].output).group(1)
        again = re.search(r"\(run ([0-9a-f]{32}) reproduces", reproduce).group(1)
        assert "identical" in reproduce and "≠" not in reproduce, reproduce
        client = MlflowClient(tracking_uri=f"sqlite:///{copy}/mlflow.db")
        tags = client.get_run(again).data.tags
        assert tags["raylane.reproduces"] == original and tags["raylane.reproduced"] == "identical"
        assert (
            tags["raylane.weights_digest"]
            == client.get_run(original).data.tags["raylane.weights_digest"]
        )
        # Code, data, versions, cluster, config, final metrics and weights all agree.
        assert f"runs {original} and {again} agree in" in compare, compare

    def test_your_data_and_model_block(self, on_cluster):
        """A Hugging Face checkpoint made here, fine-tuned on chat JSONL with its tokenizer."""
        copy, env, _ = on_cluster
        run = _ok(run_block(YOUR_MODEL, copy, env, timeout_s=600), YOUR_MODEL.where)
        train = run.command("raylane train").output
        assert "epoch 3/3" in train, train[-3000:]
        run_id = re.search(r"MLflow run ([0-9a-f]{32})", train).group(1)
        client = MlflowClient(tracking_uri=f"sqlite:///{copy}/mlflow.db")
        # Counted on the assistant's tokens alone, the loss fell far below a uniform guess.
        val_loss = client.get_run(run_id).data.metrics["val_loss"]
        assert val_loss < 0.5 * math.log(512), val_loss
        given = copy / "checkpoints" / "tiny-llama" / "tokenizer.json"
        logged = Path(client.download_artifacts(run_id, "data/tokenizer.json"))
        assert logged.read_bytes() == given.read_bytes()  # the checkpoint's own tokenizer
        manifest = json.loads(
            Path(client.download_artifacts(run_id, "data/manifest.json")).read_text()
        )
        assert manifest["files"][0]["path"] == "examples/chat/arithmetic.jsonl"
        assert manifest["chat_template"]["from"] == "tokenizer_config.json"
        # Most of each row (system and user turns, the template's markers) is masked.
        assert manifest["masked_tokens"]["train"] > manifest["tokens"]["train"] / 2, manifest
        imported = client.get_model_version("tiny-llama", "1")
        assert imported.tags["raylane.source_path"] == str(given.parent)
        # The fine-tuned model exported (export checks its weights against the run's digest)
        # is one transformers loads, with the same logits as raylane's model of that directory.
        import torch
        import transformers

        from raylane.models.hf_checkpoint import load_pretrained

        out = copy / "exported" / "llama-chat"
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out)
        tokens = torch.tensor([[1, 2, 3, 4]])
        with torch.no_grad():
            gap = (theirs(tokens).logits - load_pretrained(out)(tokens)).abs().max().item()
        assert gap <= 1e-4, gap
        assert (out / "tokenizer.json").read_bytes() == given.read_bytes()
        # LoRA on the imported version: the base read from model.pretrained (its sha256 the
        # import's), the adapter alone registered against it, and served with its tokenizer.
        finetuned = run.command("raylane finetune").output
        base, tuned = map(
            float, re.search(r"base ([\d.]+), fine-tuned ([\d.]+)", finetuned).groups()
        )
        assert tuned < base, finetuned[-2000:]
        adapter = client.get_model_version("raylane-llama-lora", "1")
        tags = adapter.tags
        assert (tags["raylane.base_model"], tags["raylane.base_version"]) == ("tiny-llama", "1")
        run_tags = client.get_run(adapter.run_id).data.tags  # the run records the base's digest
        assert run_tags["raylane.base_digest"] == imported.tags["raylane.weights_sha256"]
        generated = run.command("raylane generate").output
        assert "raylane-llama-lora v1" in generated, generated
        # Up to its 8 tokens, or fewer at the tokenizer's end-of-text (never printed).
        assert re.search(r"finish: (length, 8|stop, [1-8]) tokens", generated), generated
        # Deployed on the cluster and asked over the OpenAI API, streamed: the reply is the
        # merged model's greedy decoding without a KV cache of the prompt `transformers`'
        # apply_chat_template renders from the same messages; usage counts its tokenizer's
        # tokens, and the same request not streamed answers the same.
        import ast
        import time

        from raylane.serving.generation.engine import generate_without_cache
        from raylane.serving.generation.loader import load_language_model
        from raylane.serving.generation.sampling import SamplingParams

        deployed = run_block(YOUR_MODEL_DEPLOY, copy, env, timeout_s=300)
        try:
            _ok(deployed, YOUR_MODEL_DEPLOY.where)
            chat = subprocess.run(
                ["python", "-c", YOUR_MODEL_CHAT.text], cwd=copy, env=env, capture_output=True,
                text=True, timeout=120,
            )  # fmt: skip
            assert chat.returncode == 0, chat.stderr[-3000:]
            # The block's own request (its messages and arguments), not streamed.
            nodes = list(ast.walk(ast.parse(YOUR_MODEL_CHAT.text)))
            [messages] = [ast.literal_eval(n.value) for n in nodes if isinstance(n, ast.Assign)
                          and getattr(n.targets[0], "id", "") == "messages"]  # fmt: skip
            [call] = [n for n in nodes if isinstance(n, ast.Call)
                      and getattr(n.func, "attr", "") == "create"]  # fmt: skip
            request = {k.arg: ast.literal_eval(k.value) for k in call.keywords
                       if k.arg not in ("messages", "stream", "stream_options")}  # fmt: skip
            body = {**request, "messages": messages}
            whole = _post_json(f"{ENDPOINT}/v1/chat/completions", body)
        finally:
            stopped = run_block(YOUR_MODEL_STOP, copy, env, timeout_s=120)
        _ok(stopped, YOUR_MODEL_STOP.where)
        assert "removed Serve app 'raylane'" in stopped.output, stopped.output
        store = f"sqlite:///{copy}/mlflow.db"
        model, card = load_language_model(store, "raylane-llama-lora", 1)  # base + adapter
        tokenizer = transformers.AutoTokenizer.from_pretrained(given.parent)
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        params = SamplingParams(max_tokens=request["max_tokens"], temperature=0)
        reference = generate_without_cache(model, prompt, params, card.codec)
        text = tokenizer.decode(reference.output, skip_special_tokens=True)
        counts = f"{len(prompt)} prompt tokens, {len(reference.output)} completion tokens"
        assert chat.stdout == f"{text}\n{counts}\n" and text.strip(), (chat.stdout, text, counts)
        [choice] = whole["choices"]
        assert choice["message"]["content"] == text, (whole, text)
        assert choice["finish_reason"] == reference.finish_reason, (whole, reference.finish_reason)
        assert whole["usage"]["prompt_tokens"] == len(prompt), whole
        assert whole["usage"]["completion_tokens"] == len(reference.output), whole
        deadline = time.monotonic() + 30  # Serve stops its proxy with its last application
        while not _port_closed(8000) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _port_closed(8000), "Serve still answers on port 8000 after raylane undeploy"

    def test_custom_model_block(self, on_cluster):
        # The factory is imported from the copy's working directory, on the driver and (Ray puts
        # that directory on their import path) on every worker; tests/unit/test_custom_model.py
        # proves DDP and FSDP2 on it equal to one process.
        copy, env, _ = on_cluster
        run = _ok(run_block(CUSTOM_MODEL, copy, env, timeout_s=600), CUSTOM_MODEL.where)
        client = MlflowClient(tracking_uri=f"sqlite:///{copy}/mlflow.db")
        source = copy / "examples" / "custom_model" / "my_model.py"
        digest = hashlib.sha256(source.read_bytes()).hexdigest()
        found = client.get_run(re.search(r"MLflow run ([0-9a-f]{32})", run.output)[1])
        assert found.data.params["parallelism.strategy"] == "ddp"
        assert found.data.params["parallelism.workers"] == "2"
        assert found.data.tags["raylane.model_factory"] == (
            "examples.custom_model.my_model:residual_mlp"
        )
        assert found.data.tags["raylane.model_factory_sha256"] == digest
        assert found.data.metrics["val_accuracy"] > 0.5, found.data.metrics  # chance: 0.1
        [version] = client.search_model_versions("name='raylane-digits-custom'")
        assert version.run_id == found.info.run_id

    def test_generation_train_block(self, on_cluster):
        copy, env, _ = on_cluster
        run = _ok(run_block(GENERATE, copy, env, timeout_s=1200), GENERATE.where)
        train = run.command("raylane train").output
        assert re.search(r"val_bits_per_byte \d\.\d{4}", train), train[-3000:]
        run_id = re.search(r"MLflow run ([0-9a-f]{32})", train).group(1)
        client = MlflowClient(tracking_uri=f"sqlite:///{copy}/mlflow.db")
        bits = client.get_run(run_id).data.metrics["val_bits_per_byte"]
        assert bits < 0.7 * 8, bits  # well below a uniform guess over 256 bytes (8 bits)
        generated = run.command("raylane generate").output
        assert "raylane-lm-serve v1" in generated and "finish: length, 128 tokens" in generated
        # The text is the registered model's own seeded draw (the cache-free reference with
        # the command's defaults), not only the echoed prompt; compared on its ASCII
        # characters, since a stray byte decodes to U+FFFD once here and per piece when streamed.
        from raylane.serving.generation.engine import generate_without_cache
        from raylane.serving.generation.loader import load_language_model
        from raylane.serving.generation.sampling import SamplingParams

        model, _ = load_language_model(f"sqlite:///{copy}/mlflow.db", "raylane-lm-serve", 1)
        params = SamplingParams(max_tokens=128, temperature=0.8, seed=0)
        drawn = generate_without_cache(model, list(b"def main("), params).output
        expected = "def main(" + bytes(drawn).decode("utf-8", errors="replace")

        def ascii_only(text: str) -> str:
            return "".join(c for c in text if ord(c) < 128)

        assert ascii_only(expected) in ascii_only(generated), (expected, generated)

    def test_finetune_block(self, on_cluster):
        """After the generation block: LoRA on the LM it registered, then text from it."""
        copy, env, _ = on_cluster
        run = _ok(run_block(FINETUNE, copy, env, timeout_s=900), FINETUNE.where)
        tuned = " ".join(run.command("raylane finetune").output.split())  # lines wrap
        assert "base: raylane-lm-serve v1" in tuned and "raylane-lm-lora v1" in tuned, tuned
        found = re.search(r"python-stdlib-tests: base (\d\.\d+), fine-tuned (\d\.\d+)", tuned)
        assert found and float(found[2]) < float(found[1]), tuned  # it adapted to the new text
        generated = run.command("raylane generate").output
        assert "raylane-lm-lora v1" in generated and "def test_" in generated, generated
        second = " ".join(run.commands[-1].output.split())  # a second adapter, all projections
        assert "base: raylane-lm-serve v1" in second and "raylane-lm-lora v2" in second, second
        found = re.search(r"python-stdlib-tests: base (\d\.\d+), fine-tuned (\d\.\d+)", second)
        assert found and float(found[2]) < float(found[1]), second  # its 5 steps adapted it too
        run_id = re.search(r"MLflow run ([0-9a-f]{32})", second).group(1)
        short = MlflowClient(tracking_uri=f"sqlite:///{copy}/mlflow.db").get_run(run_id).data
        assert short.metrics["global_step"] == 5, short.metrics  # the guide's short run
        assert short.params["finetune.target_modules"] == "['q', 'k', 'v', 'proj']"


def _split_parameters(config: Path) -> int:
    """Parameters one of 2 workers holds of the GPT of `config` (lm_tp.yaml or lm_fsdp.yaml):
    FSDP half of every one (all of even length); tensor parallelism without sequence
    parallelism half of each block's q, k, v and MLP first linear (weight and bias) and of the
    attention output's and MLP second linear's weights, the rest (embeddings, norms, those
    two biases, the head) whole."""
    from raylane.models import build_model

    cfg = load_config(config)
    sizes = {name: p.numel() for name, p in build_model(cfg.model).named_parameters()}
    if cfg.parallelism.strategy == "fsdp":
        return sum(sizes.values()) // 2
    assert cfg.parallelism.strategy == "tp" and not cfg.parallelism.sequence_parallel
    split = ("attn.q.", "attn.k.", "attn.v.", "mlp.0.", "attn.proj.weight", "mlp.2.weight")
    return sum(n // 2 if any(part in name for part in split) else n for name, n in sizes.items())


def test_plan_block(readme):
    copy, env, _ = readme
    run = _ok(run_block(PLAN, copy, env, timeout_s=300), PLAN.where)
    assert "basis: catalog figures for a100-80gb" in run.output, run.output
    written = copy / "configs" / "generated" / "gpt-1p3b-plan.yaml"
    cfg = load_config(written)  # the winner is a valid training config for 32 GPUs
    assert cfg.parallelism.workers == 32 and cfg.parallelism.use_gpu
    by_cost = run.commands[-1].output  # ranked by expected cost per epoch, spot or on demand
    assert "recommended: spot capacity for" in by_cost and "Young's interval" in by_cost, by_cost
    assert load_config(
        copy / "configs" / "generated" / "gpt-1p3b-cost-plan.yaml"
    ).parallelism.use_gpu


def test_plan_llama_block(readme):
    """The guide's Llama 3 8B plan, as it says: its size, a layout pruned with the memory it
    needs, the winner a valid training config of the Llama for 32 GPUs."""
    copy, env, _ = readme
    run = _ok(run_block(PLAN_LLAMA, copy, env, timeout_s=120), PLAN_LLAMA.where)
    output = " ".join(run.output.split())  # the console wraps long lines
    assert "8.03 B parameters, 16 x 8192 tokens per step, bf16; 4 x 8 a100-80gb (32 devices)" in (
        output
    ), output
    assert "e.g. ddp dp16 cp2: needs 200.8 GB per device, has 80 GB" in output, output
    cfg = load_config(copy / "configs" / "generated" / "llama3-8b-plan.yaml")
    assert cfg.model.kind == "llama" and cfg.model.n_kv_heads == 8
    assert cfg.parallelism.workers == 32 and cfg.parallelism.use_gpu


def test_mlflow_ui_block(readme):
    copy, env, root = readme
    server = Background(MLFLOW_UI, copy, env, root / "mlflow-ui.log")
    try:
        server.wait_until_ready("http://127.0.0.1:5000/health", timeout_s=120)
        found = _get_json("http://127.0.0.1:5000/api/2.0/mlflow/experiments/search?max_results=50")
        names = {e["name"] for e in found["experiments"]}
        assert {"digits-ddp", "lm-pipeline", "lm-hybrid", "lm-parallelism"} <= names, names
    finally:
        server.interrupt()
    assert _port_closed(5000)


def test_deploy_calls_and_triton_blocks(readme):
    copy, env, root = readme
    server = Background(DEPLOY, copy, env, root / "deploy.log")
    try:
        server.wait_until_ready(f"{ENDPOINT}/v2/health/ready", timeout_s=300)
        calls = _ok(run_block(CALLS, copy, env, timeout_s=60), CALLS.where)
        oip, rows = (json.loads(c.output) for c in calls.commands)
        labels = {o["name"]: o["data"] for o in oip["outputs"]}
        assert labels["label"] == [0], oip  # the guide's digit is a 0
        assert rows["predictions"] == [0], rows

        triton = subprocess.run(
            ["python", "-c", TRITON.text], cwd=copy, env=env, capture_output=True, text=True
        )
        assert triton.returncode == 0, triton.stderr[-3000:]
        assert re.fullmatch(r"\[\d\]\n", triton.stdout), triton.stdout
    finally:
        code = server.interrupt()
    assert code != -signal.SIGKILL, server.output()[-3000:]  # Ctrl-C stopped it by itself
    assert _port_closed(8000)


def test_generation_deploy_and_openai_client_blocks(readme):
    copy, env, root = readme
    server = Background(GENERATE_DEPLOY, copy, env, root / "generate-deploy.log")
    try:
        server.wait_until_ready(f"{ENDPOINT}/v2/health/ready", timeout_s=300)
        streamed = subprocess.run(
            ["python", "-c", OPENAI_CLIENT.text], cwd=copy, env=env, capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip
        assert streamed.returncode == 0, streamed.stderr[-3000:]
        # The same greedy request, not streamed, over the OIP generate extension.
        body = {"text_input": "import os\n", "parameters": {"max_tokens": 64, "temperature": 0}}
        whole = _post_json(f"{ENDPOINT}/v2/models/pylm/generate", body)
        assert streamed.stdout == whole["text_output"] + "\n" and len(whole["text_output"]) > 16
        # The fine-tuning section's adapters (its block ran before) from the same replica.
        adapters = subprocess.run(
            ["python", "-c", ADAPTERS_CLIENT.text], cwd=copy, env=env, capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip
        assert adapters.returncode == 0, adapters.stderr[-3000:]
        answers = [line.split(None, 1) for line in adapters.stdout.splitlines()]
        assert [a[0] for a in answers] == ["pylm", "pylm:raylane-lm-lora/1",
                                           "pylm:raylane-lm-lora/2"], adapters.stdout  # fmt: skip
        assert len({a[1] for a in answers}) == 3, adapters.stdout  # three different models
    finally:
        code = server.interrupt()
    assert code != -signal.SIGKILL, server.output()[-3000:]
    assert _port_closed(8000)


def test_serve_run_block(readme):
    copy, env, root = readme
    server = Background(SERVE_RUN, copy, env, root / "serve-run.log")
    try:
        server.wait_until_ready(f"{ENDPOINT}/v2/health/ready", timeout_s=300)
        model = _get_json(f"{ENDPOINT}/v2/models/digits")
        # serving/config.yaml serves digits_ddp.yaml's registered model at its champion alias.
        client = MlflowClient(tracking_uri=f"sqlite:///{copy}/mlflow.db")
        champion = client.get_model_version_by_alias("raylane-digits", "champion")
        assert model["name"] == "digits" and model["versions"] == [str(champion.version)], model
    finally:
        server.interrupt()
        _ray_stop(copy, env)
    assert _port_closed(8000)


def test_rolling_upgrade_block(readme):
    copy, env, _ = readme
    try:
        versions = {"<old>": "1", "<new>": "2"}
        run = run_block(ROLLING, copy, env, timeout_s=900, substitutions=versions)
    finally:
        _ray_stop(copy, env)
    _ok(run, ROLLING.where)
    assert "now serves v1" in run.command("raylane promote 1").output
    assert "serving raylane-digits v2" in run.command("raylane deploy --detach --version 2").output
    status = run.command("raylane status").output
    rows = [line for line in status.splitlines() if "raylane" in line and "model" in line]
    assert rows, status
    assert all(re.search(r"\bv2\b", r) and not re.search(r"\bv1\b", r) for r in rows), status


def test_job_submit_block(readme):
    copy, env, _ = readme
    client = MlflowClient(tracking_uri=f"sqlite:///{copy}/mlflow.db")
    experiment = client.get_experiment_by_name("digits-ddp").experiment_id
    before = {r.info.run_id for r in client.search_runs([experiment])}
    try:
        run = run_block(JOBS, copy, env, timeout_s=900)
    finally:
        _ray_stop(copy, env)
    _ok(run, JOBS.where)
    submits = [c for c in run.commands if c.text.startswith("ray job submit")]
    assert len(submits) == 2
    assert all("succeeded" in c.output for c in submits), [c.output[-2000:] for c in submits]
    # The job's run landed in the store the guide points it at ($PWD/mlflow.db), with the
    # commit it was submitted from and the code its workers ran: the uploaded copy.
    (new,) = [r for r in client.search_runs([experiment]) if r.info.run_id not in before]
    assert new.data.params["parallelism.strategy"] == "ddp"
    assert new.info.status == "FINISHED" and new.data.metrics["val_accuracy"] > 0.5
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=copy, capture_output=True, text=True)
    assert new.data.tags["mlflow.source.git.commit"] == head.stdout.strip() != ""
    assert new.data.tags["raylane.code_digest"] == code_digest(copy / "platform" / "raylane")
    assert "working_dir_files" in new.data.tags["raylane.code_path"], new.data.tags
    # The deploy job served the champion from the same store.
    assert re.search(r"serving raylane-digits v\d+", submits[1].output), submits[1].output[-2000:]


def test_your_data_format_blocks(readme):
    """The data guide's example per format, prepared without Ray: the windows each command
    prints agree with the manifest, and the manifest with the files' bytes."""
    copy, env, _ = readme

    def manifest(name: str = "mine") -> dict:
        return json.loads((copy / "data" / name / "manifest.json").read_text())

    def printed(command) -> list[int]:
        return [
            int(n) for n in re.findall(r"^(?:train|validation): (\d+) rows", command.output, re.M)
        ]

    text = _ok(run_block(DATA_TEXT, copy, env, timeout_s=120), DATA_TEXT.where)
    documents = manifest()
    assert {Path(f["path"]).suffix for f in documents["files"]} == {".txt", ".md", ".py"}
    # Bytes: a token per byte of every file and an end-of-text token per file (a document).
    tokens = documents["tokens"]
    assert sum(tokens.values()) == sum(f["bytes"] + 1 for f in documents["files"]), documents
    # 64-token windows (+1 for the shifted label) back to back: all but the tail packed.
    assert printed(text.commands[0]) == [(tokens[s] - 1) // 64 for s in ("train", "validation")]

    jsonl = _ok(run_block(DATA_JSONL, copy, env, timeout_s=120), DATA_JSONL.where)
    rows = [printed(c) for c in jsonl.commands[:3]]  # text, prompt + completion, chat
    assert rows == [[28, 7], [16, 4], [229, 56]], jsonl.output
    chat = manifest()
    assert chat["documents"] == {"train": 192, "validation": 48}, chat  # 240 rows, 1 in 5 held out
    masked = re.search(r"masked (\{.*?\}) of (\{.*?\})", jsonl.commands[3].output)
    assert masked and masked[1] == str(chat["masked_tokens"]), jsonl.output
    # The system and user turns and the template's markers masked, the answers learnt.
    assert all(0.4 < chat["masked_tokens"][s] / n < 0.7 for s, n in chat["tokens"].items()), chat

    tables = _ok(run_block(DATA_TABLES, copy, env, timeout_s=120), DATA_TABLES.where)
    prepared = [printed(c) for c in tables.commands if c.text.startswith("raylane")]
    assert prepared == [[120, 30], [120, 30]], tables.output  # 150 flowers, csv then parquet
    columns = ["sepal_length", "sepal_width", "petal_length", "petal_width"]
    assert tables.commands[-1].output.strip() == str(columns), tables.output
    table = manifest("mine-table")
    assert table["files"][0]["format"] == "parquet" and table["feature_columns"] == columns

    bad = run_block(DATA_BAD_ROW, copy, env, timeout_s=120)  # its last command stops
    assert bad.returncode == 2 and len(bad.commands) == 2, bad.output
    line = (
        "examples/data/bad_row.jsonl:4: expected 'text', 'prompt'+'completion' or 'messages', "
        "found keys ['question']"
    )
    skipped, stopped = (" ".join(c.output.split()) for c in bad.commands)  # lines wrap
    assert f"skipped 1 bad row (data.on_bad_rows: skip); the first: {line}" in skipped, skipped
    assert printed(bad.commands[0]) == [7, 1], skipped  # the 6 good rows
    assert stopped == f"error: {line}", stopped
    assert manifest()["skipped_rows"] == 1 and sum(manifest()["documents"].values()) == 6
