"""Checkpoint stall: how long an asynchronous save stops training, side by side in one run, on the
state being trained.

The state: ``LAYERS`` bias-free square float32 layers plus Adam's two moments
(``checkpoint_throughput.build``: ~1 GiB and ~4 GiB), trained by a cadence ``TorchTrainer`` on one
fixed batch of ``BATCH`` rows (mean squared output), at the process' torch thread count
(``OMP_NUM_THREADS=1`` under ``make bench``); and a real model, the charlm example's transformer
scaled to a few million parameters (AdamW). Each contender saves the same state ``saves`` times,
training between and beside its saves:

- sync: ``CheckpointManager(async_save=False).save`` (cadence, crc32c). The denominator: every stall
  is also given as a fraction of its median.
- floor: one copy of every tensor into memory already allocated (``checkpoint_throughput._copy_floor``):
  what a snapshot that copies at the loop boundary cannot beat.
- cadence async, copy at the boundary (``trainer.pipelined_snapshots = False``): the stall is the
  ``save()`` call.
- cadence async, pipelined (the default): the stall is the ``save()`` call plus the wait before the
  next optimizer step (``StateFence.wait``, timed by wrapping it here), both reported.
- DCP: ``get_state_dict`` then ``torch.distributed.checkpoint.async_save`` with
  ``DefaultStager(StagingOptions(use_async_staging=True))`` (no pinned nor shared memory: CPU), the
  stall is that call plus the wait for ``staging_completion`` in an optimizer step pre-hook (the
  forward and backward passes run in between, as with cadence's).

Before each save the trainer steps alone for about a synchronous save's time (up to 5 s, at least one step);
after the save call it steps until the background save is committed. Step time during a save: the
mean of those steps less the wait they contain (the wait is the stall), over the mean of the steps
alone. Peak RSS: ``/proc/self/statm`` sampled every ``RSS_EVERY_S`` on a thread, its maximum from
the save call to the commit, over the state's bytes; next to it the peak while training alone before
the contender's first save (parameters, gradients, Adam's moments and temporaries, activations, the
interpreter), so what the save adds is the difference. First save (the staging memory allocated)
and saves 2+ (median) are reported separately.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

if __name__ == "__main__":  # run as a file: the checkout's root, not this folder, first on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # (imports `benchmarks`: see its __init__)

from benchmarks.checkpoint.throughput import BIG, LAYERS, SIZES, _copy_floor, build, nbytes  # noqa: E402
from benchmarks.checkpoint.stall_page import markdown_lines  # noqa: E402  (run.py and the tests call it from here)
from benchmarks.common.results_file import run_on_this_machine, write_results  # noqa: E402

BATCH = 8  # rows per step of the layers' state
SAVES = {"1 GiB": 4, "4 GiB": 3}
QUICK_SIZES = {"6 MiB": 256}
CHARLM = {"seq_len": 64, "d_model": 256, "heads": 8, "layers": 6, "ff": 1024, "batch_size": 8}
QUICK_CHARLM = {"seq_len": 16, "d_model": 32, "heads": 2, "layers": 1, "ff": 64, "batch_size": 4}
RSS_EVERY_S = 0.005
CONTENDERS = {
    "sync": "cadence sync save (crc32c): the denominator",
    "floor": "floor: one copy of the state into allocated memory",
    "boundary": "cadence async, copy at the boundary (pipelined_snapshots=False)",
    "pipelined": "cadence async, pipelined (default)",
    "dcp": "DCP async_save + DefaultStager(use_async_staging=True)",
}
TARGETS = {"stall_fraction": 0.05, "step_ratio_during_save": 1.10, "peak_rss_x_state": 2.2,
           "first_stall_fraction": 0.50}
TARGET_TEXT = ("cadence pipelined: stall (saves 2+) <= 5% of a sync save; steps during a save <= 1.10x; "
               "peak RSS during a save <= 2.2x the state; first save's stall <= 50% of a sync save")


# -- measuring: the training thread's waits, the peak RSS -----------------------------------------


class RssPeak:
    """The process' resident set size sampled every ``RSS_EVERY_S`` on a daemon thread;
    :meth:`reset` starts a new window, :attr:`peak` is its maximum (bytes)."""

    def __init__(self) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE")
        self.peak = self.now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)
        self._thread.start()

    def now(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def reset(self) -> None:
        self.peak = self.now()

    def _sample(self) -> None:
        while not self._stop.wait(RSS_EVERY_S):
            self.peak = max(self.peak, self.now())

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class Waits:
    """Seconds the training thread spent in cadence's ``StateFence.wait`` (wrapped while
    :meth:`fence` is entered) and in DCP's staging wait (:meth:`add`)."""

    def __init__(self) -> None:
        self.total = 0.0

    def add(self, seconds: float) -> None:
        self.total += seconds

    @contextlib.contextmanager
    def fence(self) -> Iterator[None]:
        from cadence.torch.checkpoint_io.pipelined import StateFence

        original = StateFence.wait

        def wait(fence: StateFence) -> None:
            start = time.perf_counter()
            try:
                original(fence)
            finally:
                self.add(time.perf_counter() - start)

        StateFence.wait = wait  # type: ignore[method-assign]
        try:
            yield
        finally:
            StateFence.wait = original  # type: ignore[method-assign]


# -- the workloads: a model, its optimizer, one batch, a train step ----------------------------------


class Workload:
    """What every contender trains and saves: ``model`` and ``optimizer`` (built once, shared by the
    contenders), one ``batch`` repeated, ``step`` the task's train step."""

    def __init__(self, label: str, model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any,
                 step: Callable[[nn.Module, Any], torch.Tensor], device: str = "cpu") -> None:
        self.label, self.model, self.optimizer, self.batch, self.step = label, model, optimizer, batch, step
        self.device = device

    def synchronize(self) -> None:
        """On CUDA, wait for the queued kernels: a step's time is then the device's, waits included."""
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def trainer(self, pipelined: bool = True) -> Any:
        from cadence.torch import Context, Task, build_runners

        work = self

        class Bench(Task):
            def build_model(self):
                return work.model

            def build_optimizer(self, model):
                return work.optimizer

            def build_inputs(self, split, ctx):
                return itertools.repeat(work.batch)

            def train_step(self, model, batch):
                return work.step(model, batch)

            def validation_step(self, model, batch):
                return {}

        trainer, _ = build_runners(Bench(), Context.create(device=self.device), evaluate=False)
        trainer.pipelined_snapshots = pipelined
        return trainer


def optimizer_state_made(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any,
                         step: Callable[[nn.Module, Any], torch.Tensor]) -> None:
    """One step of ``step`` on ``batch``: the optimizer's state (Adam's moments) exists, and counts in the
    state's size, before any contender runs."""
    step(model, batch).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def layers_workload(width: int) -> Workload:
    model, opt = build(width)
    x = torch.randn(BATCH, width, generator=torch.Generator().manual_seed(0))
    return Workload(f"{LAYERS} layers of {width}x{width} float32 + Adam, batch {BATCH}", model, opt, x,
                    lambda m, batch: m(batch).square().mean())


def charlm_workload(params: dict[str, int]) -> Workload:
    from benchmarks.common.example_tasks import example_task_class

    CharLMTask = example_task_class("charlm", "CharLMTask")
    torch.manual_seed(0)
    task = CharLMTask(train_samples=params["batch_size"], validation_samples=8, **params)
    model = task.build_model()
    optimizer = task.build_optimizer(model)
    optimizer_state_made(model, optimizer, task.train_set.tensors, task.train_step)
    n = sum(p.numel() for p in model.parameters())
    label = (f"charlm transformer ({params['layers']} layers, d_model {params['d_model']}, ff {params['ff']}, "
             f"seq {params['seq_len']}; {n / 1e6:.1f} M parameters) + AdamW, batch {params['batch_size']}")
    return Workload(label, model, optimizer, task.train_set.tensors, task.train_step)


# -- the contenders ---------------------------------------------------------------------------------


def _steps_for(trainer: Any, work: Workload, seconds: float, least: int = 1) -> list[float]:
    """Train one step at a time for ``seconds`` (at least ``least`` steps): each step's seconds."""
    times: list[float] = []
    end = time.perf_counter() + seconds
    while len(times) < least or time.perf_counter() < end:
        start = time.perf_counter()
        trainer.train(1)
        work.synchronize()
        times.append(time.perf_counter() - start)
    return times


def _steps_until(trainer: Any, work: Workload, done: Callable[[], bool], waits: Waits) -> tuple[list[float], float]:
    """Train one step at a time until ``done()``: each step's seconds less the waits in it, and
    the waits in the first step (after a save, the rest of the stall)."""
    times: list[float] = []
    first_wait = 0.0
    while not done():
        before = waits.total
        start = time.perf_counter()
        trainer.train(1)
        work.synchronize()
        elapsed, waited = time.perf_counter() - start, waits.total - before
        if not times:
            first_wait = waited
        times.append(elapsed - waited)
    return times, first_wait


def _in_background(fn: Callable[[], None]) -> tuple[threading.Event, list[BaseException]]:
    done, failed = threading.Event(), []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - raised on the training thread
            failed.append(e)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    return done, failed


def measure(work: Workload, key: str, saves: int, idle_s: float, base: str, rss: RssPeak) -> dict:
    """``saves`` saves of ``work``'s state by contender ``key`` (not the floor), training between and
    beside them (see the module doc)."""
    from cadence import CheckpointManager

    trainer = work.trainer(pipelined=key != "boundary")
    trainer.initialize()
    directory = f"{base}/{key}"
    waits = Waits()
    manager = CheckpointManager(directory, max_to_keep=1, async_save=key in ("boundary", "pipelined"))
    stager: Any = None
    staging: list[Any] = []  # DCP: the staging future the next optimizer step waits for
    hook = None
    if key == "dcp":
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        from cadence.torch.checkpoint_io.sharded import reusable

        cuda = work.device.startswith("cuda")  # DCP's GPU set-up: pinned memory, non-blocking copies
        stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                              use_async_staging=True, use_non_blocking_copy=cuda))

        def before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            if staging:
                start = time.perf_counter()
                staging.pop().result()
                waits.add(time.perf_counter() - start)

        hook = work.optimizer.register_step_pre_hook(before_step)
    stalls: list[float] = []
    lost_steps: list[tuple[list[float], float]] = []  # per save: the steps beside it (less waits), their waits
    boundary: list[float] = []
    background: list[float] = []
    idle: list[float] = []
    busy: list[float] = []
    peaks: list[int] = []
    rss.reset()
    try:
        with waits.fence():
            trainer.train(1)  # warm-up: the gradients allocated
            rss.reset()
            for i in range(saves):
                idle += _steps_for(trainer, work, idle_s)
                if i == 0:
                    alone = rss.peak
                rss.reset()
                start = time.perf_counter()
                if key == "dcp":  # (reusable: torch 2.11's stager fails its second save without it)
                    done_fn, failed = _dcp_save(work, reusable(stager), f"{directory}/{i}", staging)
                else:
                    manager.save(trainer.global_step, {"trainer": trainer})
                boundary.append(time.perf_counter() - start)  # the save call (not the bench's own thread below)
                if key != "dcp":
                    done, failed = _in_background(manager.wait)
                    done_fn = done.is_set
                if key == "sync":
                    stalls.append(boundary[-1])
                    background.append(boundary[-1])
                    peaks.append(rss.peak)
                    continue
                steps, wait = _steps_until(trainer, work, done_fn, waits)
                lost_steps.append((steps, wait))
                background.append(time.perf_counter() - start)
                peaks.append(rss.peak)
                if failed:
                    raise failed[0]
                busy += steps
                stalls.append(boundary[-1] + wait)
                if key == "dcp" and i:
                    shutil.rmtree(f"{directory}/{i - 1}", ignore_errors=True)
    finally:
        if hook is not None:
            hook.remove()
        if stager is not None:
            stager.close()
        manager.close()
        del trainer, manager, stager
        if nbytes(work.model, work.optimizer) >= BIG:  # the staging copies freed before the next contender
            gc.collect()
        released = release_pinned(work.device)
    idle_mean = statistics.fmean(idle)
    busy_mean = statistics.fmean(busy) if busy else None
    later = stalls[1:] or stalls
    # training time lost to each save: from the save call to the commit, less as many steps alone
    lost = [b - len(steps) * idle_mean for b, (steps, _) in zip(background, lost_steps)] or stalls
    # the save call and the first step after it (its wait included), less a step alone: the stall as the device
    # sees it (on CUDA the wait before the optimizer step is the stream's, and the host does not block)
    stepped = [b + steps[0] + wait - idle_mean for b, (steps, wait) in zip(boundary, lost_steps) if steps] or stalls
    return {
        "key": key, "contender": CONTENDERS[key], "saves": saves,
        "first_stall_s": stalls[0], "stall_s": statistics.median(later), "stalls_s": stalls,
        "first_boundary_s": boundary[0], "first_wait_s": stalls[0] - boundary[0],
        "boundary_s": statistics.median(boundary[1:] or boundary), "wait_s": statistics.median(
            [s - b for s, b in zip(later, boundary[1:] or boundary)]),
        "background_s": statistics.median(background),
        "first_lost_s": lost[0], "lost_s": statistics.median(lost[1:] or lost),
        "first_step_stall_s": stepped[0], "step_stall_s": statistics.median(stepped[1:] or stepped),
        "step_s_idle": idle_mean, "steps_idle": len(idle),
        "step_s_during_save": busy_mean, "steps_during_save": len(busy),
        "step_ratio_during_save": busy_mean / idle_mean if busy_mean is not None else None,
        "peak_rss_bytes": max(peaks), "rss_alone_bytes": alone, "pinned_released_after": released,
    }


def release_pinned(device: str) -> bool | None:
    """On CUDA, give back the pinned memory that torch's caching host allocator keeps once freed, so
    that the next contender's first save allocates its own, as a new process's first save does
    (without this, the contender after another is handed the other's staging memory: a first save
    that looks free). Whether it could (None: not CUDA)."""
    if not device.startswith("cuda"):
        return None
    gc.collect()
    memory = getattr(torch.accelerator, "memory", None) if hasattr(torch, "accelerator") else None
    empty = getattr(memory, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if empty is None:
        return False
    empty()
    return True


def _dcp_save(work: Workload, stager: Any, directory: str,
              staging: list[Any]) -> tuple[Callable[[], bool], list[BaseException]]:
    """DCP's asynchronous save of ``work``'s state (staging on ``stager``'s thread): the next
    optimizer step waits for the future put in ``staging``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

    model_sd, optim_sd = get_state_dict(work.model, work.optimizer)
    with warnings.catch_warnings():  # "torch.distributed is disabled ... assuming ... a single process"
        warnings.simplefilter("ignore", UserWarning)
        response = dcp.async_save({"model": model_sd, "optim": optim_sd}, async_stager=stager, no_dist=True,
                                  storage_writer=dcp.FileSystemWriter(directory, sync_files=True))
    assert isinstance(response, AsyncSaveResponse)  # with an async stager
    staging.append(response.staging_completion)
    failed: list[BaseException] = []

    def done() -> bool:
        if not response.upload_completion.done():
            return False
        error = response.upload_completion.exception()
        if error is not None:
            failed.append(error)
        return True

    return done, failed


# -- one state, then the whole run ------------------------------------------------------------------


def _target(name: str, value: float | None) -> dict:
    bound = TARGETS[name]
    return {"name": name, "value": value, "bound": bound, "met": None if value is None else value <= bound}


def measure_state(work: Workload, label: str, saves: int, *, root: str | None = None,
                  targets: tuple[str, ...] = tuple(TARGETS)) -> dict:
    """Every contender on ``work``'s state (see the module doc); ``targets``: those of ``TARGETS``
    that apply to it."""
    load = os.getloadavg()[0]
    size = nbytes(work.model, work.optimizer)
    base = tempfile.mkdtemp(prefix="cadence-stall-", dir=root)
    rss = RssPeak()
    rows: dict[str, dict] = {}
    try:
        with warnings.catch_warnings():  # DCP's, from its writing thread too: "torch.distributed is disabled ..."
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            rows["sync"] = measure(work, "sync", saves, 0.0, base, rss)
            idle_s = max(0.2 if size >= BIG else 0.02, min(rows["sync"]["stall_s"], 5.0))
            rows["floor"] = {"key": "floor", "contender": CONTENDERS["floor"], "first_stall_s": None,
                             "stall_s": _copy_floor(work.model, work.optimizer)}
            for key in ("boundary", "pipelined", "dcp"):
                rows[key] = measure(work, key, saves, idle_s, base, rss)
    finally:
        rss.close()
        shutil.rmtree(base, ignore_errors=True)
    denominator = rows["sync"]["stall_s"]
    for row in rows.values():
        row["stall_fraction"] = row["stall_s"] / denominator
        row["first_stall_fraction"] = (row["first_stall_s"] / denominator if row["first_stall_s"] is not None
                                       else None)
        if "peak_rss_bytes" in row:
            row["peak_rss_x_state"] = row["peak_rss_bytes"] / size
            row["rss_alone_x_state"] = row["rss_alone_bytes"] / size
    cad = rows["pipelined"]
    return {"label": label, "workload": work.label, "state_bytes": size, "state_gib": size / 2**30,
            "saves": saves, "torch_threads": torch.get_num_threads(), "load_average_1min": [load, os.getloadavg()[0]],
            "rows": list(rows.values()), "targets": [_target(name, cad[name]) for name in targets]}


def run(quick: bool = False, root: str | None = None, sizes: dict[str, int] | None = None,
        saves: int | None = None) -> dict:
    """The layers' state at each of ``sizes`` (label: width; default ``SIZES``, ``quick``: a few MiB,
    two saves), then the charlm transformer."""
    sizes = sizes or (QUICK_SIZES if quick else SIZES)
    results = []
    for label, width in sizes.items():
        work = layers_workload(width)
        results.append(measure_state(work, label, saves or (2 if quick else SAVES.get(label, 3)), root=root))
        del work
        gc.collect()
    work = charlm_workload(QUICK_CHARLM if quick else CHARLM)
    # the interpreter and torch outweigh a state of a few MiB: no RSS target; every save a first one, nearly
    results.append(measure_state(work, "charlm", saves or (2 if quick else 5), root=root,
                                 targets=("stall_fraction", "step_ratio_during_save")))
    return {"quick": quick, "states": results, "target": TARGET_TEXT, "rss_every_s": RSS_EVERY_S}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few MiB and a tiny charlm, two saves (smoke test)")
    parser.add_argument("--size", action="append", choices=list(SIZES), help="only these sizes (repeatable)")
    parser.add_argument("--saves", type=int, default=None)
    parser.add_argument("--root", default=None, help="where the checkpoints go (default: the temp dir)")
    parser.add_argument("--out", default=None, help="write the table here (and the JSON next to it)")
    args = parser.parse_args()
    sizes = {k: SIZES[k] for k in args.size} if args.size else None
    text, result = run_on_this_machine(
        "checkpoint stall", "checkpoint/stall.py",
        lambda: run(quick=args.quick, root=args.root, sizes=sizes, saves=args.saves), markdown_lines,
        results="checkpoint_stall")
    write_results(args.out, text, result)
    print(text)


if __name__ == "__main__":
    main()
