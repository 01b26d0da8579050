"""The hf_gpt2 example (examples/hf_gpt2), end to end through the CLI and offline: its tokenizer and
packed ``datasets`` blocks prepared from the repository's docs, a tiny GPT-2 trained with the sidecar
and exported as ``hf`` (which ``transformers`` alone loads and generates from), and a run killed with
SIGKILL mid-epoch that resumes bit-identically from its StatefulDataLoader's state, on 1 and 2 ranks."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from cadence.summaries.metrics_file import read_metrics
from cli_run import ENV, checkpoint_weights, kill_job, popen, run_cadence, run_python, same_weights

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "hf_gpt2"
CONFIG = EXAMPLE / "config.yaml"
SLOW_TASK = f"{ROOT / 'tests' / 'hf_example_tasks.py'}:SlowGPT2Task"
STEPS = 12
SHORT = (f"trainer.train_steps={STEPS}", "trainer.steps_per_loop=4", "trainer.checkpoint_interval=4",
         "trainer.validation_interval=4", "trainer.max_to_keep=null", "task.params.batch_size=8")


def sets(*overrides: str) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """The example's prepare step, with its defaults but for the block size."""
    out = tmp_path_factory.mktemp("hf_gpt2") / "data"
    proc = run_python([str(EXAMPLE / "prepare.py"), "--out", str(out), "--block-size", "32"], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "train/" in proc.stdout and not (out / "cache").exists()
    return out


def train(data: Path, run: Path, *extra: str, command: str = "train") -> subprocess.CompletedProcess:
    proc = run_cadence(command, str(CONFIG), "--model-dir", str(run), *(["--no-progress"] * (command == "train")),
                       *sets(f"task.params.data_dir={data}", *SHORT), *extra)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def killed_mid_epoch(data: Path, run: Path, *extra: str) -> None:
    """Start the run (the example's Task, each step slowed) and SIGKILL the whole job, cadence and every
    rank (their loader workers see their rank gone and exit), a few steps after ckpt-4 is committed:
    mid-epoch (an epoch holds hundreds of steps)."""
    pids = run.parent / "pids"
    pids.mkdir(exist_ok=True)
    proc = popen(["-m", "cadence", "train", str(CONFIG), "--model-dir", str(run), "--no-progress",
                  *sets(f"task.params.data_dir={data}", *SHORT, f"task.class={SLOW_TASK}",
                        "task.params.step_sleep=0.1", f"task.params.pid_dir={pids}"), *extra],
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV, start_new_session=True)
    manifest = run / "checkpoints" / "ckpt-4" / "MANIFEST.json"
    deadline = time.monotonic() + 120
    while not manifest.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    kill_job(proc, [int(p.read_text()) for p in pids.iterdir()])
    assert manifest.exists() and not (run / "checkpoints" / "ckpt-8").exists()


def final_weights(run: Path) -> dict:
    assert json.loads((run / "checkpoints" / "FINAL").read_text())["step"] == STEPS
    return checkpoint_weights(run / "checkpoints" / f"ckpt-{STEPS}")


def test_trained_with_the_sidecar_exported_as_hf_it_generates_and_a_killed_run_resumes_bit_identical(data, tmp_path):
    straight = tmp_path / "straight"
    train(data, straight, "--sidecar", command="launch")
    rows = read_metrics(straight / "eval" / "evaluations.jsonl")
    assert [(r["step"], r["status"]) for r in rows] == [(4, "evaluated"), (8, "evaluated"), (12, "evaluated")]
    best = json.loads((straight / "best" / "best.json").read_text())
    export = straight / "export" / "best" / str(best["step"])
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in export.iterdir()}
    generated = run_python([str(EXAMPLE / "generate.py"), str(export), "--prompt", "The sidecar", "--tokens", "8"])
    assert generated.returncode == 0, generated.stdout + generated.stderr
    assert generated.stdout.startswith("The sidecar") and len(generated.stdout) > len("The sidecar\n")

    run = tmp_path / "killed"
    killed_mid_epoch(data, run)
    state = json.loads((run / "checkpoints" / "ckpt-4" / "state.json").read_text())["state"]["trainer"]
    assert state["data"]["kind"] == "stateful"  # the StatefulDataLoader's own state, workers included
    resumed = train(data, run)
    assert "restored checkpoint" in resumed.stderr and "replaying" not in resumed.stderr
    assert same_weights(final_weights(run), final_weights(straight))


def test_two_ranks_under_fsdp_killed_mid_epoch_resume_bit_identical(data, tmp_path):
    """Two processes and FSDP (DDP's resume is the same data path: each rank's loader state)."""
    strategy = "fsdp"
    straight, run = tmp_path / "straight", tmp_path / "killed"
    on_two = ("--nproc", "2", "--set", f"trainer.strategy={strategy}")
    train(data, straight, *on_two)
    killed_mid_epoch(data, run, *on_two)
    state = json.loads((run / "checkpoints" / "ckpt-4" / "state.json").read_text())["state"]["trainer"]
    assert len(state["rank_data"]) == 2 and state["rank_data"][0] != state["rank_data"][1]
    assert (run / "checkpoints" / "ckpt-4" / ".metadata").exists() == (strategy == "fsdp")  # FSDP: sharded
    resumed = train(data, run, *on_two)
    assert "restored checkpoint" in resumed.stdout + resumed.stderr
    assert same_weights(final_weights(run), final_weights(straight))


def test_its_model_dir_exports_and_evaluates_from_any_directory(data, tmp_path):
    """Issue 40: the example's ``data_dir`` is relative to the directory it trains from; the model dir
    records that directory, so ``cadence export`` and ``evaluate`` of it work from another one."""
    project, elsewhere = data.parent, tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = tmp_path / "run"
    run_cadence("train", str(CONFIG), "--model-dir", str(run), "--no-progress",
                *sets(f"task.params.data_dir={data.name}", *SHORT, "trainer.train_steps=4", "task.params.num_workers=0"),
                cwd=project, check=True)
    exported = run_cadence("export", str(run), "--checkpoint", "best", "--format", "hf", "--out", "hf", cwd=elsewhere)
    assert exported.returncode == 0, exported.stderr
    assert (elsewhere / "hf" / "config.json").is_file() and (elsewhere / "hf" / "tokenizer.json").is_file()
    evaluated = run_cadence("evaluate", str(run / "config.yaml"), "--model-dir", str(run), "--checkpoint", "best",
                            cwd=elsewhere)
    assert evaluated.returncode == 0, evaluated.stderr
    assert json.loads(evaluated.stdout)["step"] == 4
