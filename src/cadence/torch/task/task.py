"""The class a user subclasses to describe a model's training (TF Model Garden's ``Task``)."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import torch
from torch import nn

from cadence.torch.data.batch import first_tensor
from cadence.torch.runtime.context import Context
from cadence.torch.task.lr_schedule import LRSchedule, TrainingPlan

if TYPE_CHECKING:  # signatures imports this module
    from cadence.torch.task.export_specs import ExportSpec
    from cadence.torch.task.export_specs import ExportSignature
    from cadence.torch.task.export_specs import SavesPretrained


class Task(abc.ABC):
    """What to train and how; the framework drives the loop.

    The framework constructs a task as ``TaskClass(**params)``. The base ``__init__`` keeps every
    keyword in ``self.params`` (a dict), so a simple task needs no ``__init__`` of its own; one
    that has one should call ``super().__init__(**remaining_params)``.

    Required: :meth:`build_model`, :meth:`build_optimizer`, :meth:`build_inputs`,
    :meth:`train_step`, :meth:`validation_step`. Everything else has a working default.
    """

    def __init__(self, **params: Any) -> None:
        self.params: dict[str, Any] = dict(params)

    # -- building ------------------------------------------------------------------------------

    @abc.abstractmethod
    def build_model(self) -> nn.Module:
        """A freshly initialised model (on CPU; the framework moves it to the device)."""

    @abc.abstractmethod
    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer over ``model``'s parameters.

        Called once in a training process, after ``model`` (the module :meth:`build_model` returned,
        never its DDP wrapper) was moved to its device, so a Task reads the device from the model
        (``next(model.parameters()).device``); after ``trainer.compile`` compiled it and
        ``trainer.strategy: fsdp`` sharded it, both in place; before :meth:`initialize` and before a
        checkpoint's state is restored into the model and this optimizer."""

    def build_lr_scheduler(
        self, optimizer: torch.optim.Optimizer
    ) -> torch.optim.lr_scheduler.LRScheduler | LRSchedule | None:
        """An LR scheduler, stepped once per optimizer step, or an :class:`LRSchedule` saying when to
        step it (``LRSchedule(StepLR(optimizer, 30), interval="epoch")``); ``None`` (the default) for
        none. Called by :meth:`configure_lr_scheduler`'s default; override that one to read the
        length of training."""
        return None

    def configure_lr_scheduler(
        self, optimizer: torch.optim.Optimizer, plan: TrainingPlan
    ) -> torch.optim.lr_scheduler.LRScheduler | LRSchedule | None:
        """The LR scheduler, knowing the length of training (``plan.steps_per_epoch``,
        ``plan.total_steps``: a ``OneCycleLR``'s ``total_steps``). What the framework calls, once,
        after :meth:`build_optimizer` and after the train input was built (``build_inputs("train",
        ctx)``, whose ``len()`` gives the steps per epoch), before a checkpoint is restored. A bare
        scheduler is stepped once per optimizer step; an :class:`LRSchedule` says ``interval``
        (``"step"`` or ``"epoch"``) and ``frequency``. Default: :meth:`build_lr_scheduler`."""
        return self.build_lr_scheduler(optimizer)

    @abc.abstractmethod
    def build_inputs(self, split: str, ctx: Context) -> Iterable[Any]:
        """The batches of ``split`` (``"train"`` or ``"validation"``) for this process.

        Shard with ``ctx.dp_rank`` / ``ctx.dp_size`` (the data-parallel ranks: ``rank`` / ``world_size``
        without tensor parallelism) and seed with ``ctx.seed``. For exact resume
        return something with ``state_dict`` / ``load_state_dict`` (e.g.
        :class:`cadence.torch.ResumableLoader`); a plain ``DataLoader`` with torch's samplers
        skips the batches already consumed without loading them, any other iterable replays
        them. Validation inputs are iterated afresh for each evaluation.

        ``"validation"`` may return a mapping ``{name: iterable}`` (named splits, e.g. ``{"train":
        ..., "val": ...}``): each is evaluated in turn and the metrics are nested, ``{name: {metric:
        value}}``, named ``name/metric`` elsewhere (``val/loss``).
        """

    def initialize(self, model: nn.Module) -> None:
        """Load pretrained weights and the like. Called only on a fresh start (no checkpoint).

        With ``trainer.strategy: fsdp`` on several ranks ``model`` is already sharded (its
        parameters are ``DTensor`` shards): load full weights with
        ``torch.distributed.checkpoint.state_dict.set_model_state_dict(model, state,
        options=StateDictOptions(full_state_dict=True))`` on every rank.
        """

    # -- sharding (trainer.strategy: fsdp) --------------------------------------------------------

    fsdp_unit_classes: tuple[type[nn.Module], ...] = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
    """The module classes :meth:`fsdp_units` shards as units by default."""

    def fsdp_units(self, model: nn.Module) -> list[nn.Module]:
        """The submodules of ``model`` that FSDP shards as units of their own (each all-gathers its
        parameters for its forward and backward only); the framework then shards the root, which
        takes every parameter left. Used with ``trainer.strategy: fsdp`` on several ranks.

        Default: the submodules whose class is in :attr:`fsdp_unit_classes` (transformer layers)
        or is a block a ``transformers`` model declares (its ``_no_split_modules``: GPT-2's
        ``GPT2Block``); when there are none, the root's direct children that have parameters. Units may nest
        (inner ones are sharded first). Call submodules through the root's ``forward`` (a unit
        called on its own, outside the root's forward, finds the root's parameters sharded).
        """
        from cadence.torch.parallel.sharding import default_fsdp_units

        return default_fsdp_units(model, self.fsdp_unit_classes)

    # -- tensor parallelism (trainer.parallel.tp) -------------------------------------------------

    tp_divisor: int | None = None
    """What :meth:`parallelize` splits over the tensor-parallel ranks (attention heads, a hidden
    size): ``trainer.parallel.tp`` must divide it (checked before the model is built). None: no rule."""

    def parallelize(self, model: nn.Module, tp_mesh: Any) -> nn.Module:
        """Apply this Task's tensor-parallel plan to ``model`` (on its device) over ``tp_mesh``, the
        1-D ``DeviceMesh`` of this rank's TP group (``mesh["tp"]``), e.g. with
        ``torch.distributed.tensor.parallel.parallelize_module``, and return it. Called once, with
        ``trainer.parallel.tp > 1``, before activation checkpointing, ``trainer.compile`` and
        FSDP (torchtitan's order). The ranks of a TP group read the same batches.

        Not overridden (the default): the Task has no plan, and ``tp > 1`` is refused (exit 2)."""
        raise NotImplementedError(f"{type(self).__name__} has no tensor-parallel plan (override Task.parallelize)")

    # -- steps ---------------------------------------------------------------------------------

    @abc.abstractmethod
    def train_step(self, model: nn.Module, batch: Any) -> torch.Tensor | Mapping[str, Any]:
        """Forward pass on one (micro)batch: the loss tensor, or a dict with ``"loss"`` and
        extra scalar logs (tensors or numbers; averaged over the training loop).

        The framework runs backward, gradient accumulation and clipping, the optimizer and the
        LR scheduler; the batch is already on the device and autocast is active as configured.
        """

    @abc.abstractmethod
    def validation_step(self, model: nn.Module, batch: Any) -> Mapping[str, Any]:
        """Metrics of one batch, under ``torch.no_grad()`` with the model in eval mode.

        Scalars (numbers, 1-element tensors) are averaged over the evaluation weighted by
        :meth:`batch_size_of`. Everything (scalar or not) is also handed to :meth:`aggregate_logs`.
        """

    # -- metrics that are not batch means -------------------------------------------------------

    def aggregate_logs(self, state: Any, step_outputs: Mapping[str, Any]) -> Any:
        """Fold one validation step's outputs into ``state`` (``None`` at the first step).

        Override together with :meth:`reduce_aggregated_logs` for metrics that are not means of
        batch values (AUC, F1, ...). The default does nothing and is not called.
        """
        return state

    def reduce_aggregated_logs(self, aggregated_logs: Any, global_step: int) -> dict[str, Any]:
        """Turn the aggregated state into metrics, merged into the evaluation's result."""
        return {}

    def merge_aggregated_logs(self, states: list[Any]) -> Any:
        """Merge the :meth:`aggregate_logs` states of all ranks (in rank order) into one, before
        :meth:`reduce_aggregated_logs`. Needed (overridden) by a task that overrides
        :meth:`aggregate_logs` and evaluates on several processes (a ``TypeError`` names it
        otherwise); not called on one process."""
        raise NotImplementedError

    def build_metrics(self) -> Mapping[str, Any]:
        """Metric reducers, by the name of the ``validation_step`` output each one is fed; ``{}`` by default.

        Called at the start of each evaluation (return fresh reducers). For each name, the value
        under that name in every ``validation_step`` output goes to ``reducer.update(value)`` (a
        tuple as a tuple, e.g. ``(scores, labels)``), and the reducer's value over all ranks is
        that metric in the result: exact for any number of processes with unpadded shards. Such
        keys are not batch-averaged. A value may be a :class:`cadence.metrics.MetricReducer`
        (``Mean``, ``Sum``, ``Max``, ``Min``, ``Concat(fn)``, ``FunctionReducer(fn)``, or your own),
        a ``torchmetrics.Metric`` (wrapped in :class:`cadence.torch.components.metrics.TorchMetricsReducer`),
        or a plain function of the list of all values (a ``FunctionReducer``). The reducer gets the
        value as it is, without the batch size: give ``Mean`` per-example values or a
        ``(value_sum, count)`` tuple, not a batch mean (that would weigh every batch alike)::

            def build_metrics(self):
                return {"auc": Concat(lambda scores, labels: roc_auc_score(labels, scores))}

            def validation_step(self, model, batch):
                x, y = batch
                return {"auc": (model(x).sigmoid(), y)}
        """
        return {}

    # -- helpers -------------------------------------------------------------------------------

    def batch_size_of(self, batch: Any) -> int:
        """The number of examples in ``batch``, the weight of its metrics.

        Default: dim 0 of the first tensor found depth-first in a tensor / tuple / list / dict
        (1 for a 0-d tensor). Raises ``ValueError`` when the batch has no tensor: override then.
        (Not named ``batch_size``, so that the common ``self.batch_size = 32`` cannot hide it.)
        """
        t = first_tensor(batch)
        if t is None:
            raise ValueError(
                f"{type(self).__name__}.batch_size_of: no tensor found in a batch of type "
                f"{type(batch).__name__}; override Task.batch_size_of(batch)"
            )
        return int(t.shape[0]) if t.dim() > 0 else 1

    # -- throughput (the train summaries' samples_per_second, tokens_per_second, mfu) ----------------

    def tokens_per_batch(self, batch: Any) -> int | None:
        """The number of tokens in a training ``batch``, for ``tokens_per_second``; ``None`` (the
        default): tokens are not counted (a loop with a ``None`` batch logs no tokens/s).

        Called on every training (micro-)batch, on the training thread, before it is moved to the
        device: compute it from shapes (``batch["input_ids"].numel()``), not from values -- a
        tensor's ``.item()`` would make the host wait for the device at every step.
        (Samples are counted with :meth:`batch_size_of`.)
        """
        return None

    def flops_per_sample(self) -> float | None:
        """The training FLOPs of one sample, forward and backward (about 6 x parameters x tokens
        per sample for a transformer), for model FLOP utilisation (``mfu``); called once.

        ``None`` (the default): when the device's peak is known (a GPU in cadence's table, or
        ``trainer.peak_tflops``), cadence counts them once, after the first loop, with
        ``torch.utils.flop_counter`` over :meth:`train_step` and backward on a copy of the model
        built by :meth:`build_model` on the meta device, with a batch shaped as the loop's last
        (RNG states and this task's attributes are restored after). Override when that cannot
        work (a step that needs real values, a ``build_model`` that loads weights) or to give
        your own count.
        """
        return None

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        """Example inputs for inference export: a tuple of tensors such that ``model(*inputs)`` runs.

        Needed by the export formats that trace the model (``torch_export``, ``torchscript``,
        ``onnx``); ``safetensors`` does not need them (they are recorded in its metadata when
        defined). Batch dimension first, batch size 2 or more, so that the batch dimension can be
        exported as dynamic. Values do not matter, shapes and dtypes do. Not defined by default.
        """
        raise NotImplementedError(
            f"{type(self).__name__}.example_inputs() is not defined: the 'torch_export', "
            f"'torchscript' and 'onnx' export formats trace the model on example inputs. Define it "
            f"on the task to return a tuple of tensors for model(*inputs), batch dimension first "
            f"with batch size >= 2, e.g. `def example_inputs(self): return (torch.zeros(2, 8),)`"
        )

    def export_spec(self) -> ExportSpec:
        """Which dimensions of :meth:`example_inputs` the traced exports keep dynamic, and the ONNX
        input / output names: a :class:`cadence.torch.ExportSpec`.

        Default ``ExportSpec()``: dim 0 of every input is one dynamic ``batch`` dimension (static
        shapes, with a warning, when the model cannot be exported so). Declare others as
        ``torch.export``'s ``dynamic_shapes`` does, one entry per input, a dimension by name, by
        ``(name, min, max)`` or as a ``torch.export.Dim`` (the same name in two places is one size)::

            def example_inputs(self):
                return (torch.zeros(2, 32, dtype=torch.long),)     # (batch, seq), seq <= 32

            def export_spec(self):
                return ExportSpec(dynamic_dims=[{0: "batch", 1: ("seq", 1, 32)}],
                                  input_names=["tokens"], output_names=["logits"])

        ``torch_export`` and ``onnx`` then accept any batch and sequence length in bounds; a
        ``torchscript`` trace cannot declare them (it records the shapes it saw where the model
        computes with them). Declared dimensions that the model fixes fail the export, naming them;
        a config-driven run checks the declaration against :meth:`example_inputs` before training.
        """
        from cadence.torch.task.export_specs import ExportSpec

        return ExportSpec()

    def export_signatures(self, model: nn.Module) -> Mapping[str, ExportSignature]:
        """Named inference signatures to export, each an :class:`cadence.torch.ExportSignature`
        (a module or a callable of tensors, and its example inputs); ``{}`` (the default) exports
        ``model`` itself with :meth:`example_inputs` into ``export/<name>/<step>/``.

        With signatures, each export writes ``export/<name>/<step>/<signature>/`` per signature
        (the usual files, loadable with ``load_exported``) and ``signatures.json`` beside them.
        At each export ``model`` is the trained model (unwrapped from DDP) in eval mode on CPU (a
        copy when training runs elsewhere); a config-driven run also calls this once with the
        freshly built model when it starts, only to check names and example inputs. Build the
        signatures from ``model`` (a plain callable may close over it), e.g.::

            def export_signatures(self, model):
                x = torch.zeros(2, 8)
                return {"logits": ExportSignature(model, (x,)),
                        "probs": ExportSignature(lambda x: model(x).softmax(-1), (x,))}

        Names must be safe directory names (``[A-Za-z0-9_.-]+``, not ``.`` / ``..``).
        """
        return {}

    def export_tokenizer(self) -> SavesPretrained | None:
        """The tokenizer an ``hf`` export saves beside the model (its ``save_pretrained(directory)``
        writes ``tokenizer.json`` and the like, so that ``AutoTokenizer.from_pretrained`` loads the
        export); ``None`` (the default): the export holds the model alone. Called at each export::

            def export_tokenizer(self):
                return transformers.PreTrainedTokenizerFast(tokenizer_file=self.tokenizer_file)
        """
        return None

    def build_callbacks(self) -> list:
        """The task's :class:`cadence.Callback` objects for a training run (default: none).

        Called once per run, when ``cadence train`` (``build_run``) builds the controller. They are
        combined with the config's ``callbacks:``, the task's first.
        """
        return []

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.params.items())})"
