"""Tasks with export signatures, for tests/processes/test_export_signatures.py (loaded by path:
``tests/signature_tasks.py:SignatureTask``)."""

from __future__ import annotations

import torch

from cadence.torch import ExportSignature
from tasks import TinyTask


class SignatureTask(TinyTask):
    """TinyTask exported as four signatures: ``logits`` (the model), ``probs`` (a plain callable:
    softmax over the model), ``features`` (a submodule: the first Linear + ReLU) and ``margin``
    (a plain callable of two inputs)."""

    def export_signatures(self, model):
        x = self.val_set.tensors[0][:4]
        return {
            "logits": ExportSignature(model, (x,)),
            "probs": ExportSignature(lambda x: torch.softmax(model(x), dim=-1), x),
            "features": ExportSignature(model[:2], (x,)),
            "margin": ExportSignature(lambda a, b: model(a) - model(b), (x, x.flip(0))),
        }


class BadNameTask(TinyTask):
    """A signature whose name is not a safe directory name."""

    def export_signatures(self, model):
        return {"logits": ExportSignature(model, (self.val_set.tensors[0][:4],)), "../up": ExportSignature(model)}


class NoInputsSignatureTask(TinyTask):
    """``probs`` has no example inputs: fine for safetensors, refused for a traced format."""

    def export_signatures(self, model):
        return {"logits": ExportSignature(model, (self.val_set.tensors[0][:4],)),
                "probs": ExportSignature(lambda x: torch.softmax(model(x), dim=-1))}


class EmptySignaturesTask(TinyTask):
    """Overrides export_signatures but returns {}: the model itself, the old layout."""

    def export_signatures(self, model):
        return {}
