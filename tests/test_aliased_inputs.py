"""Example inputs that share memory (``(ids, ids)`` for ids and labels) are traced as
separate inputs: the program must hold for any later call, not only for equal ones."""

import torch
from torch import nn

from autoshard.tracing.trace import trace


class TokensAndLabels(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, ids, labels):
        logits = self.head(self.emb(ids))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_the_same_tensor_twice_is_traced_as_two_inputs():
    torch.manual_seed(0)
    model = TokensAndLabels()
    ids = torch.randint(0, 16, (2, 4))
    for example in [(ids, ids), (ids, ids[:, :])]:  # one object, and a view of it
        traced = trace(model, example)
        placeholders = [n for n in traced.graph_module.graph.nodes if n.op == "placeholder"]
        assert len(placeholders) == 2 and all(n.users for n in placeholders)
        labels = torch.roll(ids, 1)
        (loss,) = traced.graph_module(ids, labels)
        assert torch.equal(loss, model(ids, labels))
