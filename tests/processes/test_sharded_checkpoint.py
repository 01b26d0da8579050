"""Sharded (FSDP2, torch.distributed.checkpoint) checkpoints end to end, in real processes: a
2-rank job killed with SIGKILL resumes bit-identically; a 2-rank checkpoint loads on 1 and 3
ranks exactly as saved; a corrupt rank shard is skipped by a resume, recorded failed by the
sidecar and refused by export; the sidecar and ``best/`` handle sharded checkpoints; a rank's
failed asynchronous shard write fails the run and leaves no partial checkpoint."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import warnings
from functools import partial
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from cadence.summaries.metrics_file import read_metrics
from cli_run import ENV as RUN_ENV, popen
from cli_run import checkpoint_weights, kill_job, reaped, run_cadence, run_torchrun, same_weights
from configs import write_config

HERE = Path(__file__).resolve().parents[1]
WORKER = HERE / "sharded_worker.py"
STEPS = 24  # checkpoints at 8, 16, 24
ENV = {**RUN_ENV, "COLUMNS": "200"}
cadence = partial(run_cadence, env={"COLUMNS": "200"})  # the CLI runner, 200 columns wide
SHARDS = ("__0_0.distcp", "__1_0.distcp")


# -- helpers ------------------------------------------------------------------------------------


def train(config: Path, model_dir: Path, *sets: str, nproc: int = 2) -> subprocess.CompletedProcess:
    args = [a for s in sets for a in ("--set", s)]
    proc = cadence("train", str(config), "--model-dir", str(model_dir), "--nproc", str(nproc), "--no-progress", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def ckpt(model_dir: Path, step: int) -> Path:
    return model_dir / "checkpoints" / f"ckpt-{step}"


def committed(model_dir: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in (model_dir / "checkpoints").iterdir()
                  if re.fullmatch(r"ckpt-\d+", p.name) and (p / "MANIFEST.json").exists())


def final_step(model_dir: Path) -> int | None:
    final = model_dir / "checkpoints" / "FINAL"
    return json.loads(final.read_text())["step"] if final.exists() else None


def rank_text(output: str, rank: int) -> str:
    """What rank ``rank`` printed (torchrun's ``[rankN]:`` prefix), rich's wrapped lines joined."""
    prefix = f"[rank{rank}]:"
    return " ".join(" ".join(line[len(prefix):].split()) for line in output.splitlines() if line.startswith(prefix))


def copy_run(source: Path, dest: Path) -> Path:
    shutil.copytree(source, dest)
    return dest


def flip_a_byte(path: Path) -> None:
    """One byte in the middle of ``path`` inverted; its size kept."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def saved_optimizer_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The optimizer's tensors in a sharded checkpoint, assembled from every rank's shards in
    this process with torch.distributed.checkpoint: ``{"<param fqn>.<name>": tensor}``."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(str(checkpoint))
    prefix = "optimizer.state."
    template = {key: torch.empty(item.size, dtype=item.properties.dtype)
                for key, item in reader.read_metadata().state_dict_metadata.items()
                if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)}
    assert template, "no optimizer state in the checkpoint"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "assuming the intent is to load in a single process"
        load(template, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    return {key[len(prefix):]: value for key, value in template.items()}


def verified(model_dir: Path, step: int) -> None:
    """Checkpoint ``step`` is committed and every file matches its manifest (raises otherwise)."""
    from cadence.checkpoint import CheckpointManager

    CheckpointManager(str(model_dir / "checkpoints"), writer=False).read(step)


# -- the uninterrupted run ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, Path]:
    """``(config, model_dir)`` of an uninterrupted 2-rank FSDP run to step 24 (sharded checkpoints
    at 8, 16, 24). Tests copy the model dir before changing anything in it."""
    tmp = tmp_path_factory.mktemp("straight")
    config = write_config(tmp, params={"n": 256}, trainer={"train_steps": STEPS, "strategy": "fsdp"})
    model_dir = tmp / "run"
    train(config, model_dir)
    assert committed(model_dir) == [8, 16, 24] and final_step(model_dir) == STEPS
    for step in (8, 16, 24):
        names = sorted(p.name for p in ckpt(model_dir, step).iterdir())
        assert names == [".metadata", "MANIFEST.json", *SHARDS, "state.json"]
        files = json.loads((ckpt(model_dir, step) / "MANIFEST.json").read_text())["files"]
        assert [files[s]["rank"] for s in SHARDS] == [0, 1]
    return config, model_dir


# -- 1. kill -9 of the whole job, then resume ---------------------------------------------------


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_two_rank_job_killed_with_sigkill_resumes_bit_identical(tmp_path, straight, async_save):
    config, reference = straight
    run = tmp_path / "run"
    pids = tmp_path / "pids"
    pids.mkdir()
    sets = [f"checkpoint.async_save={str(async_save).lower()}"]
    job = popen(
        ["-m", "cadence", "train", str(config), "--model-dir", str(run), "--nproc", "2",
         "--no-progress", *[a for s in [*sets, "task.params.step_sleep=0.1", f"task.params.pid_dir={pids}"]
                            for a in ("--set", s)]],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV, start_new_session=True,
    )
    ranks: list[int] = []
    try:
        manifest = ckpt(run, 8) / "MANIFEST.json"
        deadline = time.monotonic() + 120
        while not manifest.exists():
            assert job.poll() is None and time.monotonic() < deadline, "no first checkpoint"
            time.sleep(0.01)
        time.sleep(0.25)  # a couple of steps past the checkpoint: lost, and redone exactly
        ranks = [int((pids / f"rank{r}").read_text()) for r in (0, 1)]
        kill_job(job, ranks)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        for pid in ranks:
            if not reaped(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    assert job.returncode == -signal.SIGKILL
    for step in committed(run):  # what was committed before the kill is whole
        verified(run, step)
    killed_at = committed(run)
    assert killed_at and killed_at[0] == 8 and killed_at[-1] < STEPS, killed_at
    assert final_step(run) is None

    resumed = train(config, run, *sets)
    text = rank_text(resumed.stdout + resumed.stderr, 0)
    assert f"restored checkpoint {ckpt(run, killed_at[-1])}" in text, text
    assert "not promised to be bit-identical" not in text  # the same world size
    assert final_step(run) == STEPS and committed(run) == [8, 16, 24]
    assert not [p.name for p in (run / "checkpoints").iterdir() if ".tmp-" in p.name]  # the killed save's leftovers
    assert same_weights(checkpoint_weights(ckpt(run, STEPS)), checkpoint_weights(ckpt(reference, STEPS)))
    # the optimizer and scheduler too: each rank's shard file holds the uninterrupted run's bytes
    for shard in SHARDS:
        assert (ckpt(run, STEPS) / shard).read_bytes() == (ckpt(reference, STEPS) / shard).read_bytes(), shard


# -- 2. saved on 2 ranks, loaded on 1 and 3 -----------------------------------------------------


@pytest.mark.parametrize("nproc", [1, 3])
def test_a_two_rank_checkpoint_loads_resharded_on_another_world_size(tmp_path, straight, nproc):
    config, reference = straight

    # What the ranks load: the full model and optimizer state of the 2-rank checkpoint, bit for bit.
    out = tmp_path / "loaded.pt"
    checkpoints = copy_run(reference / "checkpoints", tmp_path / "checkpoints")
    proc = run_torchrun(nproc, str(WORKER), "restore", str(checkpoints), str(out), env={"COLUMNS": "200"},
                        timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "not promised to be bit-identical" in proc.stderr
    loaded = torch.load(out, weights_only=True)
    assert (loaded["step"], loaded["global_step"], loaded["world_size"]) == (STEPS, STEPS, nproc)
    assert loaded["sharded"] == (nproc > 1)
    saved_model = checkpoint_weights(ckpt(reference, STEPS))
    assert same_weights(loaded["model"], saved_model)
    for name, shape in ((n, t.shape) for n, t in saved_model.items()):  # each rank holds its part, no more
        held = [rank[name] for rank in loaded["held"]]
        assert len(held) == nproc and sum(h[0] for h in held) == shape[0] and all(h[1:] == shape[1:] for h in held)
    saved_optimizer = saved_optimizer_state(ckpt(reference, STEPS))
    loaded_optimizer = {f"{fqn}.{name}": value for fqn, state in loaded["optimizer_state"].items()
                        for name, value in state.items()}
    assert loaded_optimizer.keys() == saved_optimizer.keys()
    assert {k.rsplit(".", 1)[1] for k in loaded_optimizer} == {"step", "exp_avg", "exp_avg_sq"}
    for key, value in saved_optimizer.items():
        assert value.dtype == loaded_optimizer[key].dtype and torch.equal(loaded_optimizer[key], value), key
    assert loaded["lr_scheduler"]["last_epoch"] == STEPS
    group = loaded["param_groups"][0]
    assert group["lr"] == loaded["lr_scheduler"]["_last_lr"][0] == pytest.approx(0.01 * 0.9 ** (STEPS // 7))
    assert group["betas"] == (0.9, 0.999) and isinstance(group["betas"], tuple)

    # The run resumed from the 2-rank step 8 on nproc ranks: trains to the end and commits.
    run = copy_run(reference, tmp_path / "run")
    for step in (16, 24):
        shutil.rmtree(ckpt(run, step))
    (run / "checkpoints" / "FINAL").unlink()
    resumed = train(config, run, nproc=nproc)
    output = resumed.stdout + resumed.stderr
    text = rank_text(output, 0) if nproc > 1 else " ".join(output.split())
    assert f"restored checkpoint {ckpt(run, 8)}" in text, text
    assert "saved by 2 rank(s), resumed on" in text and "not promised to be bit-identical" in text, text
    assert final_step(run) == STEPS and committed(run) == [8, 16, 24]
    names = sorted(p.name for p in ckpt(run, STEPS).iterdir())
    if nproc == 1:  # one process shards nothing: a plain checkpoint
        assert "model.safetensors" in names and ".metadata" not in names
    else:
        assert [n for n in names if n.endswith(".distcp")] == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    weights = checkpoint_weights(ckpt(run, STEPS))
    assert {k: v.shape for k, v in weights.items()} == {k: v.shape for k, v in saved_model.items()}
    assert all(torch.isfinite(v).all() for v in weights.values())
    for step in (8, 16, 24):
        verified(run, step)


def test_a_model_of_another_size_is_one_line_on_a_sharded_checkpoint_and_the_model_dir_stays(tmp_path, straight):
    """Issue 39: a config that builds another model than the sharded checkpoint's (TinyTask's hidden 16 ->
    32) is bad input, found before anything is read: one line naming the first tensor and both shapes,
    exit 2, for ``evaluate`` on one process and a resume on two ranks; the model dir stays byte for byte."""
    from hashlib import sha256

    config, reference = straight
    run = copy_run(reference, tmp_path / "run")
    before = {str(p): sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir" for p in sorted(run.rglob("*"))}
    expected = (f"cadence: error: {ckpt(run, STEPS)}: the model state does not match this model: '0.weight' has "
                "shape (16, 8) in the checkpoint, (32, 8) in the model (and 2 more tensors differ in shape)")
    for command in (["evaluate", str(config)], ["train", str(config), "--nproc", "2", "--no-progress"]):
        proc = cadence("--log-level", "WARNING", *command, "--model-dir", str(run), "--set", "task.params.hidden=32")
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stderr.strip().splitlines() == [expected], proc.stderr
        after = {str(p): sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir" for p in sorted(run.rglob("*"))}
        assert after == before, command[0]


# -- 3. a corrupt rank shard --------------------------------------------------------------------


@pytest.fixture
def corrupt(tmp_path, straight) -> Path:
    """A copy of the uninterrupted run whose latest checkpoint has a byte of rank 1's shards flipped."""
    run = copy_run(straight[1], tmp_path / "run")
    shard = ckpt(run, STEPS) / "__1_0.distcp"
    size = shard.stat().st_size
    flip_a_byte(shard)
    assert shard.stat().st_size == size
    return run


def test_a_resume_skips_a_checkpoint_with_a_corrupt_rank_shard(straight, corrupt):
    config, reference = straight
    resumed = train(config, corrupt)
    output = resumed.stdout + resumed.stderr
    for rank in (0, 1):  # the ranks agree: both skip it
        text = rank_text(output, rank)
        assert f"skipping checkpoint {ckpt(corrupt, STEPS)}: __1_0.distcp does not match" in text, text
    assert f"restored checkpoint {ckpt(corrupt, 16)}" in rank_text(output, 0)
    assert final_step(corrupt) == STEPS and committed(corrupt) == [8, 16, 24]
    assert [p.name for p in (corrupt / "checkpoints").iterdir() if ".corrupt-" in p.name]  # moved aside
    # trained again from step 16: the uninterrupted run's step 24, every rank's file
    assert same_weights(checkpoint_weights(ckpt(corrupt, STEPS)), checkpoint_weights(ckpt(reference, STEPS)))
    for shard in SHARDS:
        assert (ckpt(corrupt, STEPS) / shard).read_bytes() == (ckpt(reference, STEPS) / shard).read_bytes()


def test_the_sidecar_records_a_checkpoint_with_a_corrupt_rank_shard_as_failed(straight, corrupt):
    config, _ = straight
    proc = run_cadence("evaluate", str(config), "--model-dir", str(corrupt), "--continuous",
                       "--set", "sidecar.max_retries=1", "--set", "sidecar.retry_backoff=0.05")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = read_metrics(corrupt / "eval" / "evaluations.jsonl")
    assert [(r["step"], r["status"]) for r in rows] == [(8, "evaluated"), (16, "evaluated"), (24, "failed")]
    assert "__1_0.distcp does not match its crc32c" in rows[-1]["error"]
    summary = json.loads(proc.stdout)
    assert (summary["evaluated"], summary["failed"]) == ([8, 16], [24])


def test_export_refuses_a_checkpoint_with_a_corrupt_rank_shard_in_one_line(corrupt):
    out = corrupt.parent / "exported"
    proc = run_cadence("export", str(corrupt), "--checkpoint", str(STEPS), "--format", "safetensors",
                       "--out", str(out))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{ckpt(corrupt, STEPS)}: __1_0.distcp does not match" in lines[0], lines[0]
    assert not out.exists() or not any(out.rglob("*.safetensors"))


# -- 4. the sidecar, best/ and export -----------------------------------------------------------


def test_the_sidecar_evaluates_every_sharded_checkpoint_and_best_exports_the_full_model(tmp_path, straight):
    config, reference = straight
    run = copy_run(reference, tmp_path / "run")
    in_process = {r["step"]: r for r in read_metrics(reference / "eval")}  # the 2-rank run's own evaluations
    proc = run_cadence("evaluate", str(config), "--model-dir", str(run), "--continuous",
                       "--set", "trainer.best_checkpoint.metric=accuracy")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    rows = read_metrics(run / "eval" / "evaluations.jsonl")
    assert [(r["step"], r["status"]) for r in rows] == [(8, "evaluated"), (16, "evaluated"), (24, "evaluated")]
    for row in rows:  # the full model, assembled in one process, evaluates as the 2 sharded ranks did
        assert row["metrics"]["accuracy"] == in_process[row["step"]]["accuracy"]
        assert row["metrics"]["loss"] == pytest.approx(in_process[row["step"]]["loss"], rel=1e-6)

    best = json.loads((run / "best" / "best.json").read_text())
    top = max(rows, key=lambda r: r["metrics"]["accuracy"])
    assert (best["step"], best["value"]) == (top["step"], top["metrics"]["accuracy"])
    step = best["step"]
    names = sorted(p.name for p in (run / "best" / f"ckpt-{step}").iterdir())
    assert names == [".metadata", "MANIFEST.json", *SHARDS, "state.json"]  # a sharded checkpoint
    assert same_weights(checkpoint_weights(run / "best" / f"ckpt-{step}"), checkpoint_weights(ckpt(run, step)))

    exported = run_cadence("export", str(run), "--format", "safetensors")
    assert exported.returncode == 0, exported.stdout + exported.stderr
    model = load_file(run / "export" / "best" / str(step) / "model.safetensors")
    assert same_weights(model, checkpoint_weights(ckpt(run, step)))


# -- 5. a failed asynchronous shard write -------------------------------------------------------


def test_a_failed_asynchronous_shard_write_on_one_rank_fails_the_run_and_commits_nothing(tmp_path, straight):
    run = tmp_path / "run"
    first = ckpt(run, 8) / "MANIFEST.json"
    cfg = {"task": {"class": f"{WORKER}:QuotaTask",
                    # rank 1 may write no file past 16 KiB once checkpoint 8 is committed (its shards are ~50 KiB)
                    "params": {"n": 256, "quota_rank": 1, "quota_from_step": 9, "quota_after": str(first),
                               "quota_bytes": 16384}},
           "trainer": {"train_steps": STEPS, "steps_per_loop": 4, "checkpoint_interval": 8,
                       "validation_interval": 8, "max_to_keep": None, "seed": 1, "strategy": "fsdp"},
           "checkpoint": {"async_save": True}}
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    proc = cadence("train", str(config), "--model-dir", str(run), "--nproc", "2", "--no-progress")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    failed = [line for line in output.splitlines() if line.startswith("[rank0]:") and "cadence: failed:" in line]
    assert len(failed) == 1, output
    # one line naming the rank whose write failed and why (not DCP's traceback summaries)
    assert "could not write the checkpoint shards" in failed[0], failed[0]
    assert "rank 1: OSError: [Errno 27] File too large" in failed[0] and "FrameSummary" not in failed[0], failed[0]
    assert "Traceback" not in rank_text(output, 0), output
    # nothing of step 16 (or later) visible; step 8 whole
    assert committed(run) == [8] and final_step(run) is None
    assert not [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(("ckpt-16", "ckpt-24"))]
    verified(run, 8)
    assert same_weights(checkpoint_weights(ckpt(run, 8)), checkpoint_weights(ckpt(straight[1], 8)))


def test_a_failed_background_shard_write_is_raised_on_every_rank_once(tmp_path):
    proc = run_torchrun(2, str(WORKER), "fail", str(tmp_path), env={"COLUMNS": "200"}, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, result in enumerate(results):
        for what in ("wait", "save"):  # wait_for_shards on every rank; the chief's save_checkpoint
            message = result[what]
            assert message is not None, (rank, what)
            assert "could not write the checkpoint shards" in message, message
            assert "rank 1: NotADirectoryError" in message and "FrameSummary" not in message, message
            assert len(message.splitlines()) == 1, message
    # the failure was raised once: the next save's files, every rank's, reach the chief's manifest
    assert results[0]["added"] == [[[".metadata", "__0_0.distcp"], 0], [["__1_0.distcp"], 1]]
