"""``--optimizer muon``: Muon for a model's hidden weight matrices, AdamW for the rest.

Muon (``torch.optim.Muon``) orthogonalizes each update of a 2-D weight with a few
Newton-Schulz iterations; it is meant for the matrices inside the network, not for an
embedding table, the output layer, norms or biases, which AdamW trains (as in Muon's own
write-up and in MuLoCo, arXiv 2505.23725, which uses it as DiLoCo's inner optimizer).
:func:`split` draws the line, by module:

* **Muon**: the weight of every ``nn.Linear`` but the model's last one;
* **AdamW**: everything else: embeddings (``nn.Embedding``), the last ``nn.Linear`` (the
  output head: a language model's logits, a classifier's classes), norms, biases,
  convolutions (``torch.optim.Muon`` takes 2-D parameters only) and any parameter of a
  module of another kind.

"The last ``nn.Linear``" (in ``model.modules()`` order) as the head is our rule; a model
whose head is not its last linear layer can name it with :func:`split`'s ``head``.

One learning rate serves both: Muon's update is rescaled to AdamW's RMS
(``adjust_lr_fn="match_rms_adamw"``, 0.2·√max(A, B) for an A×B matrix, Moonshot's rule
that lets Muon reuse AdamW's rate and weight decay); ``muon_lr`` sets Muon's apart. Muon's
momentum is 0.95 with Nesterov (torch's defaults); AdamW keeps torch's betas.

:class:`MuonAdamW` is one ``torch.optim.Optimizer`` (one ``state_dict``, one set of parameter
groups, each tagged ``kind``: ``muon`` or ``adamw``), so a schedule, a checkpoint or a method
that reads the optimizer's state sees one optimizer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def split(model: nn.Module, head: str | None = None) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's parameters, AdamW's) of ``model``'s trainable parameters (module docstring);
    ``head``: the name of the output module, instead of the last ``nn.Linear``. Raises
    ``ValueError`` when no parameter is Muon's."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    head_name = head if head is not None else (linears[-1][0] if linears else None)
    if head is not None and head not in dict(model.named_modules()):
        raise ValueError(f"muon: the model has no module named {head!r} (the output head)")
    hidden = {id(m.weight) for name, m in linears if name != head_name and m.weight.requires_grad}
    params = [p for p in model.parameters() if p.requires_grad]
    muon = [p for p in params if id(p) in hidden]
    if not muon:
        raise ValueError("--optimizer muon needs a model with 2-D hidden weights (an nn.Linear before its output "
                         "layer); this model has none: use adamw")
    return muon, [p for p in params if id(p) not in hidden]


class MuonAdamW(torch.optim.Optimizer):
    """Muon on ``muon_params``, AdamW on ``adamw_params``: one optimizer (module docstring)."""

    def __init__(self, muon_params: list[nn.Parameter], adamw_params: list[nn.Parameter], lr: float,
                 weight_decay: float = 0.0, muon_lr: float | None = None, muon_momentum: float = 0.95) -> None:
        self._muon = torch.optim.Muon(muon_params, lr=lr if muon_lr is None else muon_lr, weight_decay=weight_decay,
                                      momentum=muon_momentum, adjust_lr_fn="match_rms_adamw")
        inner: list[torch.optim.Optimizer] = [self._muon]
        groups = [dict(self._muon.param_groups[0], kind="muon")]
        if adamw_params:
            self._adamw: torch.optim.Optimizer | None = torch.optim.AdamW(adamw_params, lr=lr,
                                                                            weight_decay=weight_decay)
            inner.append(self._adamw)
            groups.append(dict(self._adamw.param_groups[0], kind="adamw"))
        else:
            self._adamw = None
        super().__init__(groups, {"lr": lr})
        self._link()

    def _link(self) -> None:
        """Point the inner optimizers at this one's groups and state (after a load too)."""
        self._muon.param_groups = [g for g in self.param_groups if g["kind"] == "muon"]
        self._muon.state = self.state
        if self._adamw is not None:
            self._adamw.param_groups = [g for g in self.param_groups if g["kind"] == "adamw"]
            self._adamw.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._muon.step()
        if self._adamw is not None:
            self._adamw.step()
        return loss


def muon_adamw(model: nn.Module, lr: float, weight_decay: float = 0.0, muon_lr: float | None = None) -> MuonAdamW:
    """:class:`MuonAdamW` over ``model`` split by :func:`split`."""
    muon, adamw = split(model)
    return MuonAdamW(muon, adamw, lr, weight_decay=weight_decay, muon_lr=muon_lr)
