"""torchdata's StatefulDataLoader as the train data (with worker processes): cadence checkpoints
its state (tensors included) in state.json, every rank its own, and a run killed mid-epoch
resumes bit-identically, on one process and on two."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml

from cadence.torch.data.state import from_json, to_json
from cli_run import checkpoint_weights, ENV, kill_job, popen, run_cadence, same_weights

TASK = f"{Path(__file__).parents[1] / 'tasks.py'}:StatefulLoaderTask"
STEPS = 24


def config(tmp_path: Path, **params) -> Path:
    cfg = {"task": {"class": TASK, "params": {"n": 512, **params}},
           "trainer": {"train_steps": STEPS, "steps_per_loop": 4, "checkpoint_interval": 8,
                       "validation_interval": 8, "max_to_keep": None, "seed": 1}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def train(cfg: Path, run: Path, *extra: str) -> subprocess.CompletedProcess:
    proc = run_cadence("train", str(cfg), "--model-dir", str(run), "--no-progress", *extra)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def weights(run: Path) -> dict:
    return checkpoint_weights(run / "checkpoints" / f"ckpt-{STEPS}")


def killed_after_first_checkpoint(cfg: Path, run: Path, *extra: str) -> None:
    """Start a run, SIGKILL its whole job a few steps after ckpt-8 is committed: cadence's process
    group (the launcher too) and every rank (a torchrun rank has a session of its own)."""
    pids = run.parent / "pids"
    pids.mkdir(exist_ok=True)
    proc = popen(["-m", "cadence", "train", str(cfg), "--model-dir", str(run), "--no-progress",
                  "--set", "task.params.step_sleep=0.05", "--set", f"task.params.pid_dir={pids}", *extra],
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV, start_new_session=True)
    manifest = run / "checkpoints" / "ckpt-8" / "MANIFEST.json"
    deadline = time.monotonic() + 120
    while not manifest.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # a few steps past the checkpoint, mid-epoch: lost, and redone exactly
    kill_job(proc, [int(p.read_text()) for p in pids.iterdir()])
    assert manifest.exists() and not (run / "checkpoints" / f"ckpt-{STEPS}").exists()


def test_the_state_of_a_stateful_dataloader_round_trips_through_json():
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(torch.utils.data.TensorDataset(torch.arange(40.0)), batch_size=4, shuffle=True,
                                num_workers=2)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    encoded = json.loads(json.dumps(to_json(state)))
    decoded = from_json(encoded)
    assert repr(decoded) == repr(state)  # tensors (the generator's state), int keys and tuples included
    generator = state["_snapshot"]["_main_snapshot"]["_sampler_iter_state"]["sampler_iter_state"]["generator"]
    assert torch.equal(decoded["_snapshot"]["_main_snapshot"]["_sampler_iter_state"]["sampler_iter_state"]
                       ["generator"], generator)
    expected = [b[0].tolist() for b in it]
    again = StatefulDataLoader(torch.utils.data.TensorDataset(torch.arange(40.0)), batch_size=4, shuffle=True,
                               num_workers=2)
    again.load_state_dict(decoded)
    assert [b[0].tolist() for b in again] == expected


def test_data_state_json_keeps_types_and_refuses_what_it_cannot_hold():
    value = {"a": (1, 2.5, "x"), 3: [None, True], "t": torch.tensor([[1.5, -2.0]], dtype=torch.bfloat16),
             "e": torch.empty(0, dtype=torch.int64), "__tuple__": 1}
    back = from_json(json.loads(json.dumps(to_json(value))))
    assert back["a"] == (1, 2.5, "x") and back[3] == [None, True] and back["__tuple__"] == 1
    assert back["t"].dtype == torch.bfloat16 and torch.equal(back["t"], value["t"])
    assert back["e"].shape == (0,) and back["e"].dtype == torch.int64
    with pytest.raises(TypeError, match=r"holds a set at data\.s"):
        to_json({"s": {1}})


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[dict, dict]:
    """Uninterrupted runs: one process, and two."""
    tmp = tmp_path_factory.mktemp("stateful-straight")
    cfg = config(tmp)
    train(cfg, tmp / "one")
    train(cfg, tmp / "two", "--nproc", "2")
    return weights(tmp / "one"), weights(tmp / "two")


def test_killed_mid_epoch_with_two_workers_resumes_bit_identical(tmp_path, straight):
    cfg, run = config(tmp_path), tmp_path / "run"
    killed_after_first_checkpoint(cfg, run)
    state = json.loads((run / "checkpoints" / "ckpt-8" / "state.json").read_text())["state"]["trainer"]
    assert state["data"]["kind"] == "stateful" and "rank_data" not in state  # one rank: no per-rank states
    resumed = train(cfg, run)
    assert "restored checkpoint" in resumed.stderr and "replaying" not in resumed.stderr
    assert same_weights(weights(run), straight[0])


def test_two_ranks_killed_mid_epoch_resume_bit_identical_each_from_its_own_state(tmp_path, straight):
    cfg, run = config(tmp_path), tmp_path / "run"
    killed_after_first_checkpoint(cfg, run, "--nproc", "2")
    state = json.loads((run / "checkpoints" / "ckpt-8" / "state.json").read_text())["state"]["trainer"]
    assert len(state["rank_data"]) == 2 and state["rank_data"][0] != state["rank_data"][1]
    train(cfg, run, "--nproc", "2")
    assert same_weights(weights(run), straight[1])


def test_resumed_on_another_world_size_it_warns(tmp_path):
    cfg, run = config(tmp_path), tmp_path / "run"
    train(cfg, run, "--nproc", "2", "--set", "trainer.train_steps=8")
    resumed = train(cfg, run, "--set", "trainer.train_steps=12")
    assert "the train data's position is per rank" in " ".join(resumed.stderr.split())  # rich wraps lines
    assert (run / "checkpoints" / "ckpt-12" / "MANIFEST.json").exists()


@pytest.mark.parametrize("stateful", [True, False])
def test_closing_the_train_data_ends_its_loaders_workers_at_once(stateful):
    """A run's end closes its train data (``Run.release``): a loader's workers stopped mid-epoch exit
    then. Left to the garbage collector, the iterator's ``__del__`` (run by the ``gc.collect`` of the
    distributed shutdown) waited 5 s for each worker: a 2-rank run ended 10 s late."""
    from torch.utils.data import DataLoader, TensorDataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    from cadence.torch import Context
    from cadence.torch.loop.train_data import TrainData
    from tasks import TinyTask

    dataset = TensorDataset(torch.arange(64.0).view(32, 2))
    loader = (StatefulDataLoader if stateful else DataLoader)(dataset, batch_size=2, num_workers=2)
    data = TrainData(TinyTask(), Context.create(device="cpu"), loader)
    iterator = data.iterator()
    next(iterator), next(iterator)
    inner = getattr(iterator, "_iterator", iterator)  # a plain DataLoader's, tracking its workers' RNG states
    workers = list(inner._workers)
    assert len(workers) == 2 and all(w.is_alive() for w in workers)
    data.close()
    assert not any(w.is_alive() for w in workers)
    assert data.iterator() is not iterator  # a new iteration starts after close
    data.close()
