"""SaveCheckpointIfPreempted with the real Controller and CheckpointManager, in process, with real
signals (``os.kill(os.getpid(), ...)`` from inside the fake trainer). Every test runs under a
fixture that puts back pytest's own handlers, whatever happens."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from cadence import CheckpointError, Controller
from cadence.actions import ConditionalAction, PeriodicAction, SaveCheckpointIfPreempted
from cadence.errors import PreemptedExit
from cadence.checkpoint import CheckpointManager
from fakes import MODEL_FILE, FakeTrainer

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


@pytest.fixture(autouse=True)
def restore_handlers():
    saved = {s: signal.getsignal(s) for s in SIGNALS}
    try:
        yield saved
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def kill(sig: int) -> None:
    os.kill(os.getpid(), sig)


def ckpt_manager(tmp_path: Path, **kw) -> CheckpointManager:
    return CheckpointManager(str(tmp_path / "checkpoints"), max_to_keep=None, **kw)


def build(tmp_path: Path, trainer: FakeTrainer, action: SaveCheckpointIfPreempted, **kw) -> Controller:
    kw.setdefault("checkpoint_interval", 10)
    return Controller(trainer=trainer, checkpoint_manager=ckpt_manager(tmp_path), steps_per_loop=3,
                      train_actions=[action], progress=False, **kw)


def sum_to(n: int) -> int:
    return n * (n + 1) // 2


def assert_verifies(tmp_path: Path, step: int) -> None:
    """Checkpoint ``step`` is committed, its files match the manifest, and it restores."""
    manager = ckpt_manager(tmp_path, writer=False)
    reader, state = manager.read(step)
    assert set(reader.names()) == {MODEL_FILE, "extra.bin", "state.json"}
    fresh = FakeTrainer()
    assert manager.restore({"trainer": fresh}, step) == step
    assert (fresh.step, fresh.value) == (step, sum_to(step))


# ------------------------------------------------------------------ save and exit


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT], ids=lambda s: s.name)
def test_signal_saves_at_the_current_step_and_exits_zero(tmp_path, sig):
    trainer = FakeTrainer(on_step={7: lambda: kill(sig)})
    action = SaveCheckpointIfPreempted()
    controller = build(tmp_path, trainer, action)
    assert signal.getsignal(sig) == action._handle

    with pytest.raises(SystemExit) as exit_info:
        controller.train(30)
    assert exit_info.value.code == 0
    # the signal came during the loop 7..9: saved at 9 (not an interval step), nothing trained after
    assert trainer.global_step == 9
    manager = ckpt_manager(tmp_path, writer=False)
    assert manager.steps() == [9]
    assert manager.final_step() is None
    assert_verifies(tmp_path, 9)
    controller.close()


def test_exit_code_is_configurable(tmp_path):
    trainer = FakeTrainer(on_step={2: lambda: kill(signal.SIGTERM)})
    controller = build(tmp_path, trainer, SaveCheckpointIfPreempted(exit_code=3))
    with pytest.raises(SystemExit) as exit_info:
        controller.train(30)
    assert exit_info.value.code == 3
    assert ckpt_manager(tmp_path, writer=False).steps() == [3]
    controller.close()


def test_preempted_run_resumes_from_the_preemption_checkpoint(tmp_path):
    trainer = FakeTrainer(on_step={14: lambda: kill(signal.SIGTERM)})
    controller = build(tmp_path, trainer, SaveCheckpointIfPreempted())
    with pytest.raises(SystemExit):
        controller.train(30)
    controller.close()
    assert ckpt_manager(tmp_path, writer=False).steps() == [12, 15]  # interval 10 crossed at 12

    resumed = FakeTrainer()
    controller = build(tmp_path, resumed, SaveCheckpointIfPreempted())
    assert controller.restored_step == 15
    controller.train(30)
    assert (resumed.step, resumed.value) == (30, sum_to(30))
    assert ckpt_manager(tmp_path, writer=False).final_step() == 30
    controller.close()


def test_keep_running_saves_and_trains_to_the_end(tmp_path):
    trainer = FakeTrainer(on_step={7: lambda: kill(signal.SIGTERM)})
    action = SaveCheckpointIfPreempted(keep_running=True)
    controller = build(tmp_path, trainer, action)
    controller.train(12)
    assert trainer.global_step == 12
    assert not action.preempted and action.received is None
    manager = ckpt_manager(tmp_path, writer=False)
    assert manager.steps() == [9, 12]  # 9: the signal's; 12: interval 10 crossed, and completion
    assert manager.final_step() == 12
    assert_verifies(tmp_path, 9)

    # a second signal later is handled again
    trainer.on_step[14] = lambda: kill(signal.SIGUSR1)
    controller.train(18)
    assert manager.steps() == [9, 12, 15, 18]
    controller.close()


# ------------------------------------------------------------------ signals during the save


def test_second_sigint_during_the_preemption_save_neither_interrupts_nor_corrupts_it(tmp_path):
    trainer = FakeTrainer(on_step={7: lambda: kill(signal.SIGINT)}, on_save={9: lambda: kill(signal.SIGINT)})
    controller = build(tmp_path, trainer, SaveCheckpointIfPreempted())
    with pytest.raises(SystemExit) as exit_info:  # not KeyboardInterrupt
        controller.train(30)
    assert exit_info.value.code == 0
    assert trainer.saves == [9]  # the save ran to its end (the file after the signal was written)
    assert ckpt_manager(tmp_path, writer=False).steps() == [9]
    assert_verifies(tmp_path, 9)
    controller.close()


def test_sigterm_during_the_preemption_save_is_harmless(tmp_path):
    trainer = FakeTrainer(on_step={7: lambda: kill(signal.SIGTERM)}, on_save={9: lambda: kill(signal.SIGTERM)})
    controller = build(tmp_path, trainer, SaveCheckpointIfPreempted())
    with pytest.raises(SystemExit):
        controller.train(30)
    assert trainer.saves == [9]
    assert_verifies(tmp_path, 9)
    controller.close()


def test_signal_during_an_interval_save_lets_it_finish_then_preempts(tmp_path):
    # interval 3: the controller saves at 6; SIGTERM arrives while it is being written
    trainer = FakeTrainer(on_save={6: lambda: kill(signal.SIGTERM)})
    controller = build(tmp_path, trainer, SaveCheckpointIfPreempted(), checkpoint_interval=3)
    with pytest.raises(SystemExit):
        controller.train(30)
    assert_verifies(tmp_path, 6)
    # acted on at the end of the next inner loop
    assert ckpt_manager(tmp_path, writer=False).steps() == [3, 6, 9]
    assert_verifies(tmp_path, 9)
    controller.close()


# ------------------------------------------------------------------ SIGINT twice: the way out


def test_sigint_twice_before_the_save_raises_keyboard_interrupt(tmp_path):
    def twice():
        kill(signal.SIGINT)
        kill(signal.SIGINT)

    trainer = FakeTrainer(on_step={7: twice})
    controller = build(tmp_path, trainer, SaveCheckpointIfPreempted(), checkpoint_interval=3)
    with pytest.raises(KeyboardInterrupt):
        controller.train(30)
    assert trainer.global_step == 7  # raised at once, inside the inner loop
    manager = ckpt_manager(tmp_path, writer=False)
    assert manager.steps() == [3, 6]  # no checkpoint for the interrupted loop, earlier ones intact
    assert manager.final_step() is None
    assert_verifies(tmp_path, 6)
    controller.close()


def test_sigint_once_then_again_in_a_later_loop_raises_before_the_save(tmp_path):
    """The first SIGINT is recorded; a second one before the action's save gets out at once."""
    trainer = FakeTrainer(on_step={7: lambda: kill(signal.SIGINT), 8: lambda: kill(signal.SIGINT)})
    controller = build(tmp_path, trainer, SaveCheckpointIfPreempted())
    with pytest.raises(KeyboardInterrupt):
        controller.train(30)
    assert ckpt_manager(tmp_path, writer=False).steps() == []
    controller.close()


def test_sigint_twice_after_a_sigterm_still_gets_out(tmp_path):
    def signals():
        kill(signal.SIGTERM)
        kill(signal.SIGINT)
        kill(signal.SIGINT)

    trainer = FakeTrainer(on_step={7: signals})
    controller = build(tmp_path, trainer, SaveCheckpointIfPreempted())
    with pytest.raises(KeyboardInterrupt):
        controller.train(30)


# ------------------------------------------------------------------ handlers


def test_close_restores_the_previous_handlers(tmp_path, restore_handlers):
    before = {s: signal.getsignal(s) for s in SIGNALS}
    action = SaveCheckpointIfPreempted()
    controller = build(tmp_path, FakeTrainer(), action)
    for s in SIGNALS:
        assert signal.getsignal(s) == action._handle
    controller.close()
    assert {s: signal.getsignal(s) for s in SIGNALS} == before
    controller.close()  # idempotent
    assert {s: signal.getsignal(s) for s in SIGNALS} == before


def test_close_restores_the_handlers_of_a_wrapped_action(tmp_path, restore_handlers):
    """A preemption action inside a ConditionalAction (and that inside a PeriodicAction) is
    attached and closed like an unwrapped one: close() puts the previous handlers back."""
    before = {s: signal.getsignal(s) for s in SIGNALS}
    action = SaveCheckpointIfPreempted()
    wrapped = PeriodicAction(ConditionalAction(lambda output: True, action), every_n_steps=3)
    controller = build(tmp_path, FakeTrainer(on_step={4: lambda: kill(signal.SIGTERM)}), wrapped)
    for s in SIGNALS:
        assert signal.getsignal(s) == action._handle
    with pytest.raises(PreemptedExit):
        controller.train(30)  # the wrapped action saves and exits at the end of the loop at step 6
    assert ckpt_manager(tmp_path, writer=False).steps() == [6]
    controller.close()
    assert {s: signal.getsignal(s) for s in SIGNALS} == before


def test_close_restores_a_custom_previous_handler(tmp_path):
    seen = []

    def mine(signum, frame):
        seen.append(signum)

    signal.signal(signal.SIGUSR1, mine)
    with build(tmp_path, FakeTrainer(), SaveCheckpointIfPreempted(signals=[signal.SIGUSR1])):
        assert signal.getsignal(signal.SIGUSR1) != mine
    assert signal.getsignal(signal.SIGUSR1) == mine
    kill(signal.SIGUSR1)
    assert seen == [signal.SIGUSR1]


def test_only_the_given_signals_are_handled(tmp_path):
    before = {s: signal.getsignal(s) for s in SIGNALS}
    action = SaveCheckpointIfPreempted(signals=[signal.SIGUSR1])
    controller = build(tmp_path, FakeTrainer(), action)
    assert signal.getsignal(signal.SIGUSR1) == action._handle
    assert signal.getsignal(signal.SIGTERM) == before[signal.SIGTERM]
    assert signal.getsignal(signal.SIGINT) == before[signal.SIGINT]
    controller.close()


def test_no_signal_no_effect(tmp_path):
    trainer = FakeTrainer()
    action = SaveCheckpointIfPreempted()
    controller = build(tmp_path, trainer, action)
    controller.train(12)
    assert not action.preempted
    assert ckpt_manager(tmp_path, writer=False).steps() == [12] and trainer.saves == [12]
    controller.close()


def test_reattached_action_still_restores_the_original_handlers(tmp_path):
    before = {s: signal.getsignal(s) for s in SIGNALS}
    action = SaveCheckpointIfPreempted()
    build(tmp_path, FakeTrainer(), action)
    second = build(tmp_path, FakeTrainer(), action)  # e.g. rebuilt after an error, same actions list
    second.close()
    assert {s: signal.getsignal(s) for s in SIGNALS} == before


def test_failed_construction_leaves_no_handlers_behind(tmp_path):
    before = {s: signal.getsignal(s) for s in SIGNALS}
    with pytest.raises(CheckpointError):
        build(tmp_path, FakeTrainer(), SaveCheckpointIfPreempted(), restore_step=99)
    assert {s: signal.getsignal(s) for s in SIGNALS} == before
