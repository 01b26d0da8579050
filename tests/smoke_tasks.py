"""Tasks for tests/processes/test_smoke.py (loaded by path: ``tests/smoke_tasks.py:SmokeTask``), each with
one realistic bug for ``cadence smoke`` to find."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from cadence.torch import ExportSignature, ResumableLoader, Task


def synthetic(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x[:, :4].sum(dim=1) > 0).long())


class SmokeTask(Task):
    """A healthy task: an 8-16-2 MLP with dropout, Adam and a StepLR schedule, a resumable loader."""

    def __init__(self, **params) -> None:
        super().__init__(**params)
        self.train_set, self.val_set = synthetic(64, seed=1), synthetic(40, seed=2)

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))

    def build_optimizer(self, model):
        return torch.optim.Adam(model.parameters(), lr=1e-2)

    def build_lr_scheduler(self, optimizer):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    def build_inputs(self, split, ctx):
        if split == "train":
            return ResumableLoader(self.train_set, 8, shuffle=True, seed=ctx.seed)
        return DataLoader(self.val_set, batch_size=8)

    def example_inputs(self):
        return (self.val_set.tensors[0][:4],)

    def train_step(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    def validation_step(self, model, batch):
        x, y = batch
        logits = model(x)
        return {"loss": F.cross_entropy(logits, y), "accuracy": (logits.argmax(1) == y).float().mean()}


class NoMetricsTask(SmokeTask):
    """validation_step returns no metrics (an empty dict)."""

    def validation_step(self, model, batch):
        return {}


class EvalFailsTask(SmokeTask):
    """validation_step expects float labels, and the validation data has integer ones."""

    def validation_step(self, model, batch):
        _, y = batch
        if y.dtype != torch.float32:
            raise ValueError(f"validation labels must be float32 for the metric, got {y.dtype}")
        return {}


class BuildFailsTask(SmokeTask):
    def build_model(self) -> nn.Module:
        raise RuntimeError("build_model: cannot find the pretrained weights 'weights/mlp.pt'")


class NaNTask(SmokeTask):
    """The loss becomes NaN from the second training step on (a log of a zero probability)."""

    def __init__(self, **params) -> None:
        super().__init__(**params)
        self.calls = 0

    def train_step(self, model, batch):
        self.calls += 1
        loss = super().train_step(model, batch)
        return loss * float("nan") if self.calls >= 2 else loss


class RandomFeatures(nn.Module):
    """Random features kept out of the checkpoint "to save space" (a non-persistent buffer), but
    drawn from the global RNG instead of a fixed seed: a resumed run gets other features."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("projection", torch.randn(8, 8), persistent=False)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(torch.relu(x @ self.projection))


class UnrestoredBufferTask(SmokeTask):
    def build_model(self) -> nn.Module:
        return RandomFeatures()


class SignaturesTask(SmokeTask):
    """Exports two signatures: the logits, and the class probabilities."""

    def export_signatures(self, model):
        x = self.val_set.tensors[0][:4]
        return {"logits": ExportSignature(model, (x,)),
                "probs": ExportSignature(lambda x: model(x).softmax(-1), (x,))}
