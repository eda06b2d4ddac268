"""Model factories for the tests: each returns (model, example_inputs).

Rank processes load them by path (`tests/models.py:name`), so they must be
module-level functions with no arguments.
"""

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
from gpt import gpt as example_gpt  # noqa: E402
from llama import llama as example_llama  # noqa: E402
from mlp import mlp as example_mlp  # noqa: E402


def mlp():
    return example_mlp(batch=8, seq=4, hidden=16, layers=2, dropout=0.1)


def mlp_2d_input():
    model, (x,) = example_mlp(batch=8, seq=4, hidden=16, layers=2, dropout=0.0)
    return model, (x.reshape(32, 16),)


class ThreeLinears(nn.Module):
    """X[T,H] through three linears; the middle one is W[H,O] with no bias."""

    def __init__(self, d_in=8, hidden=16, out=32):
        super().__init__()
        self.first = nn.Linear(d_in, hidden)
        self.middle = nn.Linear(hidden, out, bias=False)
        self.last = nn.Linear(out, d_in)

    def forward(self, x):
        return self.last(torch.relu(self.middle(torch.tanh(self.first(x)))))


T, H, O = 16, 16, 32


def three_linears():
    return ThreeLinears(8, H, O), (torch.randn(T, 8),)


class Branchy(nn.Module):
    """Data-dependent control flow: torch.export cannot trace it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:
            return self.fc(x)
        return x


def branchy():
    return Branchy(), (torch.randn(4, 8),)


class _PerturbedOnCopy(nn.Module):
    """Its deep copy (the serial reference) has one weight nudged by 1e-3."""

    def __init__(self):
        super().__init__()
        self.inner = example_mlp(batch=8, seq=4, hidden=16, layers=2, dropout=0.0)[0]

    def forward(self, x):
        return self.inner(x)

    def __deepcopy__(self, memo):
        twin = _PerturbedOnCopy.__new__(_PerturbedOnCopy)
        nn.Module.__init__(twin)
        twin.inner = __import__("copy").deepcopy(self.inner, memo)
        with torch.no_grad():
            twin.inner.layers[0].fc1.weight[0, 0] += 1e-3
        return twin


def perturbed_mlp():
    return _PerturbedOnCopy(), (torch.randn(8, 4, 16),)


def indivisible_mlp():
    """Hidden size 5 cannot be split over a mesh axis of 2."""
    return example_mlp(batch=8, seq=4, hidden=5, layers=1, dropout=0.0)


class CumulativeMax(nn.Module):
    """aten.cummax has no sharding rule: it must run replicated, with a warning."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x):
        return self.fc2(torch.cummax(self.fc1(x), dim=-1).values)


def cumulative_max():
    return CumulativeMax(), (torch.randn(8, 4, 16),)


class PaddedEmbeddings(nn.Module):
    """Embeddings whose padding row must get no gradient, in every sharded form, and
    token ids that hit it: `words` (64 rows) is split by vocabulary with the padding
    row on the third of four row blocks; `kinds` (6 rows, which four ranks cannot
    share) by features; `counted` scales gradients by frequency, which autoshard
    does not claim (it runs replicated, with a warning); `capped` renormalizes rows
    in place (max_norm), through an op with no rule."""

    def __init__(self, vocab=64, kinds=6, hidden=16):
        super().__init__()
        self.words = nn.Embedding(vocab, hidden, padding_idx=37)
        self.kinds = nn.Embedding(kinds, hidden, padding_idx=2)
        self.counted = nn.Embedding(vocab, hidden, scale_grad_by_freq=True)
        self.capped = nn.Embedding(vocab, hidden, max_norm=1.0)
        self.head = nn.Linear(hidden, hidden)

    def forward(self, ids, kinds):
        x = self.words(ids) + self.kinds(kinds) + self.counted(ids) + self.capped(ids)
        return self.head(torch.tanh(x))


def padded_embeddings():
    ids = torch.randint(0, 64, (8, 4))
    ids[:, 0] = 37  # the padding row
    ids[:, 1] = 32  # the first row of the padding row's block: local row 0 there
    kinds = torch.randint(0, 6, (8, 4))
    kinds[::2, 2] = 2
    return PaddedEmbeddings(), (ids, kinds)


class Router(nn.Module):
    """A mixture-of-experts router: a one-output gate (no 3D layout divides it), top-k
    of its scores (two outputs, no rule) and an expert mix weighted by them."""

    def __init__(self, hidden=16, experts=4):
        super().__init__()
        self.gate = nn.Linear(hidden, 1)
        self.scores = nn.Linear(hidden, experts)
        self.expert = nn.Linear(hidden, hidden)

    def forward(self, x):
        weights, _ = torch.topk(torch.softmax(self.scores(x), dim=-1), 2, dim=-1)
        mixed = self.expert(x) * weights.sum(-1, keepdim=True)
        return mixed * torch.sigmoid(self.gate(x))


def router():
    return Router(), (torch.randn(8, 4, 16),)


class ScalarTypeAs(nn.Module):
    """`scalar.type_as(x)` has the scalar's shape, not x's (DeBERTa's attention scale)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x)
        scale = torch.tensor(4.0).type_as(h)
        return h / torch.sqrt(scale)


def scalar_type_as():
    return ScalarTypeAs(), (torch.randn(8, 4, 16),)


class SetOfBuffers(nn.Module):
    """Meets its buffers in the order a Python set iterates their names, which changes
    with PYTHONHASHSEED (ModernBERT does this for its rotary tables)."""

    NAMES = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta")

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        for i, name in enumerate(self.NAMES):
            self.register_buffer(name, torch.full((16,), float(i)))

    def forward(self, x):
        h = self.fc(x)
        return sum(h * getattr(self, name) for name in set(self.NAMES))


def set_of_buffers():
    return SetOfBuffers(), (torch.randn(8, 4, 16),)


class Arguments(nn.Module):
    """Ops called with the arguments their rules must honour or decline: layer norms
    without weight or bias and with their own eps, a sum over `dim=[]` (every dim),
    and cross-entropies with `ignore_index` (hit by the targets), "sum", per-class
    weights, label smoothing, "none" and probabilities as targets."""

    def __init__(self, hidden=16, classes=8):
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)
        self.bias = nn.Parameter(torch.randn(hidden))
        self.head = nn.Linear(hidden, classes)
        self.register_buffer("class_weight", torch.rand(classes) + 0.5)

    def forward(self, x, target):
        h = self.fc(x)
        h = nn.functional.layer_norm(h, (h.shape[-1],), None, None, 1e-2)
        h = nn.functional.layer_norm(h, (h.shape[-1],), None, self.bias, 1e-3)
        logits = self.head(torch.tanh(h)).flatten(0, 1)
        ce = nn.functional.cross_entropy
        return (
            torch.sum(h, dim=[]),
            ce(logits, target, ignore_index=3),
            ce(logits, target, reduction="sum"),
            ce(logits, target, weight=self.class_weight),
            ce(logits, target, label_smoothing=0.1),
            ce(logits, target, reduction="none"),
            ce(logits, logits.detach().softmax(-1)),
        )


def arguments():
    target = torch.randint(0, 8, (32,))
    target[::3] = 3  # ignored
    return Arguments(), (torch.randn(8, 4, 16), target)


class OffsetNorm(nn.Module):
    """A layer norm over features far from zero (mean 1000, spread about 1), its weight
    frozen: statistics combined across ranks must not cancel, and the frozen weight
    gets no gradient while the bias and the input do."""

    def __init__(self, d_in=8, hidden=32):
        super().__init__()
        self.up = nn.Linear(d_in, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.norm.weight.requires_grad_(False)
        self.down = nn.Linear(hidden, d_in)

    def forward(self, x):
        return self.down(self.norm(self.up(x) + 1000.0))


def offset_norm():
    return OffsetNorm(), (torch.randn(16, 8, requires_grad=True),)


class LowestMask(nn.Module):
    """A causal mask filled with the lowest value of the activations' dtype, made with
    no dtype given (XGLM's ``torch.full(shape, torch.finfo(dtype).min)``): in float64
    that value is float64 only, which the float64 reference must allow."""

    def __init__(self, hidden=8):
        super().__init__()
        self.score = nn.Linear(hidden, 4)

    def forward(self, x):
        scores = self.score(x)  # [batch, 4, 4]
        mask = torch.full((4, 4), torch.finfo(scores.dtype).min).triu(1)
        return (scores + mask).softmax(-1)


def lowest_mask():
    return LowestMask(), (torch.randn(8, 4, 8),)


# The GPT and LLaMA examples with a batch of 8, which "dp" splits over 8 ranks, and a
# LLaMA whose 4 key/value heads split over a tensor-parallel axis of 4.
def gpt_batch8():
    return example_gpt(batch=8)


def llama_batch8():
    return example_llama(batch=8)


def llama_kv4():
    return example_llama(n_kv_head=4)


class ReturnsItsWeight(nn.Module):
    """Returns a parameter itself beside its output, which the serial model's optimizer
    step then updates in place: the comparison must hold what forward returned."""

    def __init__(self, hidden=16):
        super().__init__()
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        return self.down(self.up(x)), self.down.weight


def returns_its_weight():
    return ReturnsItsWeight(), (torch.randn(4, 8, 16),)


class ReturnsWhatNothingReads(nn.Module):
    """Returns, beside its output, a buffer and a parameter no op of it reads."""

    def __init__(self, hidden=16):
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)
        self.register_buffer("steps", torch.arange(4.0))
        self.scale = nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        return self.proj(x), self.steps, self.scale


def returns_what_nothing_reads():
    return ReturnsWhatNothingReads(), (torch.randn(4, 8, 16),)


def upcasts_its_output():
    """An fp32 model returning its output in float64: still measured against a
    float64 reference, its fp32 rounding and all."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    return UpcastsItsOutput(model), (torch.randn(8, 16),)


class UpcastsItsOutput(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x).double()


def offset_norm_in_float64():
    """`offset_norm` built in float64: its serial program is its own reference. Its
    statistics, combined over ranks, and its contractions sum in another order: a few
    ulps off, which the norm's features far from zero amplify."""
    model, (x,) = offset_norm()
    return model.double(), (x.detach().double().requires_grad_(x.requires_grad),)


class ScaledByAScalar(nn.Module):
    """A 0-d input (a temperature) that scales a layer's output."""

    def __init__(self, hidden=16):
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x, temperature):
        return self.proj(x) / temperature


def scaled_by_a_scalar():
    return ScaledByAScalar(), (torch.randn(4, 8, 16), torch.tensor(2.0))


class CastsInForward(nn.Module):
    """A softmax computed in float64 and cast back to float32, and a bfloat16 round trip
    (``h.to(torch.bfloat16).float()``), as mixed-precision code writes them."""

    def __init__(self, hidden=16):
        super().__init__()
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        h = self.up(x).double().softmax(-1).float()
        return self.down(h + 0.01 * h.to(torch.bfloat16).to(torch.float32))


def casts_in_forward():
    return CastsInForward(), (torch.randn(4, 8, 16),)


class SparseEmbedding(nn.Module):
    """An embedding with sparse gradients (``sparse=True``), which no rule splits."""

    def __init__(self, vocab=40, hidden=16):
        super().__init__()
        self.embedding = nn.Embedding(vocab, hidden, sparse=True)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, ids):
        return self.proj(self.embedding(ids))


def sparse_embedding():
    return SparseEmbedding(), (torch.randint(0, 40, (4, 8)),)


class CheckpointedCasts(nn.Module):
    """A block under activation checkpointing that casts to float32 inside (as Hugging
    Face's RMS norms do, with ``gradient_checkpointing_enable()``): backward recomputes
    it, casting as forward did."""

    def __init__(self, hidden=16):
        super().__init__()
        self.up = nn.Linear(hidden, hidden)
        self.down = nn.Linear(hidden, hidden)

    def block(self, x):
        h = self.up(x)
        scale = h.to(torch.float32).pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt()
        return h * scale.to(h.dtype)

    def forward(self, x):
        return self.down(torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False))


def checkpointed_casts():
    return CheckpointedCasts(), (torch.randn(4, 8, 16),)


class NormedBlock(nn.Module):
    """A block whose batch norm, in training, updates its running statistics and
    counts its batches: buffers made outside the block, updated in place."""

    def __init__(self, d: int):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.norm = nn.BatchNorm1d(4 * d)

    def forward(self, x):
        return x + self.down(torch.relu(self.norm(self.up(x))))


class PlainBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class NormedBlocks(nn.Module):
    def __init__(self, d: int = 16, depth: int = 4):
        super().__init__()
        kinds = (NormedBlock, PlainBlock)
        self.blocks = nn.ModuleList(kinds[i % 2](d) for i in range(depth))
        self.head = nn.Linear(d, d)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def normed_blocks():
    return NormedBlocks(), (torch.randn(32, 16),)
