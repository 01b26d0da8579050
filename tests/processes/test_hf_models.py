"""A transformers GPT-2 through the CLI (issue 30, items 1, 2 and 6), with tests/hf_tasks.py's tiny Task: a run
killed with SIGKILL resumes to the uninterrupted run's weights bit for bit, its tie intact in every checkpoint;
its ``hf`` exports (every evaluation, and ``cadence export --format hf``) load with ``from_pretrained``
offline and give the checkpoint's logits; without ``transformers`` the config exits 2 naming the extra."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from cadence.summaries.metrics_file import read_metrics
from cli_run import checkpoint_weights, popen, run_cadence, run_python, same_weights
from configs import write_config

TASK = "hf_tasks.py:TinyHFGPT2Task"
HEAD, WTE = "lm_head.weight", "transformer.wte.weight"
TRAINER = {"train_steps": 16, "steps_per_loop": 4, "checkpoint_interval": 4, "validation_interval": 8}

CHECK = """
import sys, torch
from transformers import AutoModelForCausalLM
sys.path.insert(0, {tests!r})
from cadence.summaries.metrics_file import read_metrics
from cli_run import checkpoint_weights
from hf_tasks import tiny_gpt2
from pathlib import Path
x = torch.arange(32).view(2, 16) % 32
reference = tiny_gpt2()
reference.load_state_dict(checkpoint_weights(Path({checkpoint!r})))
assert reference.lm_head.weight is reference.transformer.wte.weight
for export in sys.argv[1:]:
    model = AutoModelForCausalLM.from_pretrained(export, local_files_only=True).eval()
    assert model.lm_head.weight is model.transformer.wte.weight, export
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, reference.eval()(input_ids=x).logits), export
        model.generate(x[:, :4], attention_mask=torch.ones(2, 4, dtype=torch.long), max_new_tokens=4, pad_token_id=0)
print("ok")
"""


def test_hf_gpt2_resumes_bit_identically_after_kill_and_exports_hf(tmp_path):
    config = write_config(tmp_path, TASK, params={"n_tokens": 1024, "step_sleep": 0.05}, trainer=TRAINER,
                          export={"formats": ["hf"], "on": "every_eval"})
    reference, run = tmp_path / "reference", tmp_path / "run"
    proc = popen(["-m", "cadence", "train", str(config), "--model-dir", str(run), "--no-progress"])
    manifest = run / "checkpoints" / "ckpt-8" / "MANIFEST.json"
    deadline = time.monotonic() + 120
    while not manifest.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # steps past the checkpoint: lost, and redone exactly
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert not (run / "checkpoints" / "ckpt-16").exists(), "the run finished before it was killed"
    run_cadence("train", str(config), "--model-dir", str(reference), "--no-progress", check=True)
    proc = run_cadence("train", str(config), "--model-dir", str(run), "--no-progress", check=True)
    assert "restored checkpoint" in proc.stdout + proc.stderr  # it went on from ckpt-8 (or later)
    final = checkpoint_weights(run / "checkpoints" / "ckpt-16")
    assert same_weights(final, checkpoint_weights(reference / "checkpoints" / "ckpt-16"))
    assert torch_equal(final[HEAD], final[WTE])  # the tie's two names in every checkpoint

    out = tmp_path / "exported"
    proc = run_cadence("export", str(run), "--checkpoint", "latest", "--format", "hf", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= set(os.listdir(out))
    every_eval = run / "export" / "every_eval" / "16"
    assert_loads_as(run / "checkpoints" / "ckpt-16", out, every_eval)


def assert_loads_as(checkpoint: Path, *exports: Path) -> None:
    """Each of ``exports`` loads with ``from_pretrained`` (in a fresh process), tied, and gives the logits of the
    GPT-2 holding ``checkpoint``'s weights (consolidated when sharded), and generates."""
    check = CHECK.format(tests=str(Path(__file__).parents[1]), checkpoint=str(checkpoint))
    proc = run_python(["-c", check, *map(str, exports)])
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_hf_gpt2_under_fsdp_on_2_processes_exports_hf_consolidated(tmp_path):
    config = write_config(tmp_path, TASK, params={"n_tokens": 512}, export={"formats": ["hf"], "on": "final"},
                          trainer={**TRAINER, "train_steps": 8, "validation_interval": 8, "strategy": "fsdp"})
    run, out = tmp_path / "run", tmp_path / "exported"
    run_cadence("train", str(config), "--model-dir", str(run), "--nproc", "2", "--no-progress", check=True)
    assert (run / "checkpoints" / "ckpt-8" / ".metadata").exists()  # sharded: the blocks were FSDP units
    run_cadence("export", str(run), "--checkpoint", "latest", "--format", "hf", "--out", str(out), check=True)
    assert_loads_as(run / "checkpoints" / "ckpt-8", run / "export" / "final" / "8", out)
    # a fine-tune of the export starts from exactly its weights, loaded into the sharded model
    tune = tmp_path / "tune"
    run_cadence("train", str(config), "--model-dir", str(tune), "--nproc", "2", "--no-progress", "--set",
                f"task.init_from_pretrained={out}", "--set", "trainer.train_steps=4", "--set",
                "trainer.eval_at_start=true", check=True)
    (at_start,) = [r for r in read_metrics(tune / "eval") if r["step"] == 0]
    (trained,) = [r for r in read_metrics(run / "eval") if r["step"] == 8]
    assert at_start["loss"] == trained["loss"], (at_start, trained)


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


BLOCKED = "import sys; sys.modules['transformers'] = None; from cadence.cli.main import main; raise SystemExit(main())"


def test_without_transformers_or_pretrained_dir_a_config_exits_2_in_one_line(tmp_path):
    config = write_config(tmp_path, TASK, trainer=TRAINER)
    proc = run_python(["-c", BLOCKED, "train", str(config), "--model-dir", str(tmp_path / "run")])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'cadence[hf]'" in lines[0] and "transformers" in lines[0], proc.stderr
    missing = tmp_path / "no-such-export"
    proc = run_cadence("train", str(config), "--model-dir", str(tmp_path / "run"), "--no-progress",
                       "--set", f"task.init_from_pretrained={missing}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"task.init_from_pretrained: {missing} is not a directory" in proc.stderr.strip().splitlines()[-1]
