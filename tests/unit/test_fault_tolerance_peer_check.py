"""What a healing replica group checks of its peer (``cadence.torch.fault_tolerance.peer_check``):
the config digests (per-group fields left out, the differing fields named, one line), the world
size (the sender's forged: groups of several processes are not built in this tree yet); and the
EMA handed over in the healing state (``healing.py``): a healed group's EMA is its peer's, not the
healed weights."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from cadence.config import ExperimentConfig
from cadence.config.components.ema import EMAConfig
from cadence.torch import Context
from cadence.torch.components.ema import ModelEMA
from cadence.torch.fault_tolerance.healing import healing_state, load_healing_state
from cadence.torch.fault_tolerance.peer_check import config_digests, differing_fields, group_identity, refusal
from configs import config_data


def config(**trainer) -> ExperimentConfig:
    data = config_data(trainer={"fault_tolerance": {"replica_groups": 2, "replica_id": 0}, **trainer})
    return ExperimentConfig.model_validate(data)


def identity(cfg: ExperimentConfig, replica_id: int = 1, world_size: int = 1) -> dict:
    return group_identity(cfg, replica_id, world_size)


def test_the_same_training_with_other_per_group_fields_passes():
    mine = config()
    theirs = ExperimentConfig.model_validate({
        **mine.model_dump(by_alias=True), "model_dir": "/elsewhere",
        "trainer": {**mine.trainer.model_dump(), "device": "cpu", "hang_timeout": 60.0, "log_throughput": False,
                    "fault_tolerance": {"replica_groups": 2, "replica_id": 1, "lighthouse": "http://h:1",
                                        "timeout_s": 5.0}},
        "checkpoint": {"async_save": False}, "loggers": {"wandb": {"mode": "offline"}}})
    assert config_digests(mine) == config_digests(theirs)
    assert refusal(identity(mine), identity(theirs, replica_id=0)) is None
    assert "trainer.grad_clip_norm" in config_digests(mine) and "model_dir" not in config_digests(mine)


def test_a_different_setting_is_named_in_one_line():
    line = refusal(identity(config(grad_clip_norm=1.0)), identity(config(), replica_id=0))
    assert line == ("trainer.fault_tolerance: replica group 1 cannot join group 0: its config differs from "
                    "group 0's in trainer.grad_clip_norm (every group must run the same config on the same "
                    "number of processes)")
    # replica_groups is not per group: a group started for 3 groups is refused by one started for 2
    assert "trainer.fault_tolerance.replica_groups" in refusal(
        identity(config(fault_tolerance={"replica_groups": 3, "replica_id": 1})), identity(config(), 0))


def test_a_section_on_one_side_only_is_named_once_and_many_are_counted():
    assert differing_fields(config_digests(config(ema={"decay": 0.9})), config_digests(config())) == ["trainer.ema"]
    mine = config(ema={"decay": 0.9}, grad_clip_norm=1.0, seed=7, grad_accum_steps=2)
    line = refusal(identity(mine), identity(config(), 0))
    assert "in trainer.ema, trainer.grad_accum_steps, trainer.grad_clip_norm and 1 more (" in line
    task = ExperimentConfig.model_validate(config_data(params={"hidden": 8}))
    assert differing_fields(config_digests(task), config_digests(config())) == [
        "task.params", "trainer.fault_tolerance"]  # {} against {hidden: 8}; null against the section


def test_another_world_size_is_refused():
    cfg = config()
    line = refusal(identity(cfg, world_size=2), identity(cfg, replica_id=0, world_size=1))
    assert line == ("trainer.fault_tolerance: replica group 1 cannot join group 0: it runs 2 process(es), group 0 "
                    "runs 1 (every group must run the same config on the same number of processes)")
    both = refusal(identity(config(seed=3), world_size=2), identity(cfg, replica_id=0))
    assert "in trainer.seed; it runs 2 process(es), group 0 runs 1 (" in both
    assert "sent no description" in refusal(identity(cfg), None)  # a peer of another cadence version


def trainer_parts(seed: int) -> SimpleNamespace:
    """The parts a healing state is read from and loaded into (a TrainerParts): a tiny model, its Adam
    and StepLR, and an EMA of its weights."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    return SimpleNamespace(model=model, optimizer=optimizer, grad_scaler=None, ema=ModelEMA(model, EMAConfig(decay=0.5)),
                           lr_scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 2), ctx=Context(device="cpu", seed=1))


def train(parts: SimpleNamespace, steps: int) -> None:
    for step in range(1, steps + 1):
        parts.optimizer.zero_grad()
        parts.model(torch.randn(16, 4)).sum().backward()
        parts.optimizer.step()
        parts.lr_scheduler.step()
        parts.ema.on_train_step_end(None, step)


def test_the_ema_is_handed_over_with_the_weights():
    peer, healed = trainer_parts(0), trainer_parts(1)
    train(peer, 5)
    averages = {k: t.clone() for k, t in peer.ema.averaged_state().items()}
    weights = peer.model.state_dict()
    assert any(not torch.equal(averages[k], weights[k]) for k in averages)  # the average is not the weights
    assert load_healing_state(healed, healing_state(peer, 5)) == 5
    for name, average in healed.ema.averaged_state().items():
        assert torch.equal(average, averages[name]), name
    assert all(torch.equal(t, weights[k]) for k, t in healed.model.state_dict().items())
    # a peer without an EMA: the healed group's starts from the healed weights
    state = healing_state(peer, 5)
    state["ema"] = None
    load_healing_state(healed, state)
    assert all(torch.equal(t, weights[k]) for k, t in healed.ema.averaged_state().items())


def test_group_identity_is_plain_data():
    found = group_identity(config(), 0, 1)
    assert set(found) == {"replica_id", "world_size", "config"}
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in found["config"].items())
