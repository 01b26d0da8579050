"""Hugging Face ``transformers`` models in cadence: the loss of a ``CausalLMOutput``
(:func:`causal_lm_loss`), the ``hf`` export format's ``save_pretrained`` directory
(:mod:`cadence.torch.hf.save`), starting from a ``save_pretrained`` directory's weights
(:func:`load_pretrained`, ``task.init_from_pretrained``), the ``Trainer``'s weight-decay parameter groups
(:func:`parameter_groups`), and the ``cadence[hf]`` extra's checks.

Nothing here imports ``transformers`` at module level: a model that is a ``PreTrainedModel`` has
imported it already, and the functions that need it import it (a one-line error naming the extra
when it is missing).
"""

from cadence.torch.hf.dependency import HF_INSTALL, require_transformers
from cadence.torch.hf.loss import causal_lm_loss
from cadence.torch.hf.models import find_pretrained
from cadence.torch.hf.optim import decay_parameter_names, parameter_groups
from cadence.torch.hf.pretrained import load_pretrained, read_pretrained_state

__all__ = ["HF_INSTALL", "causal_lm_loss", "decay_parameter_names", "find_pretrained", "load_pretrained",
           "parameter_groups", "read_pretrained_state", "require_transformers"]
