"""Small models built around one op each, for the rules the zoo needs (`test_rules.py`).

Loaded by path in the rank processes (`tests/op_models.py:conv2d`): module-level
factories with no arguments returning ``(model, example_inputs)``.
"""

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class Conv2d(nn.Module):
    """A strided, padded patch conv with a bias, then a dilated grouped one without."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(4, 16, kernel_size=3, stride=2, padding=1)
        self.grouped = nn.Conv2d(16, 8, kernel_size=3, padding=2, dilation=2, groups=4, bias=False)

    def forward(self, x):
        return self.grouped(torch.relu(self.patch(x)))


class Conv1d(nn.Module):
    """Mamba's causal depthwise conv1d (groups = channels), then a pointwise conv."""

    def __init__(self, channels=16):
        super().__init__()
        self.depthwise = nn.Conv1d(channels, channels, kernel_size=4, padding=3, groups=channels)
        self.pointwise = nn.Conv1d(channels, 8, kernel_size=1)

    def forward(self, x):
        y = self.depthwise(x)[..., : x.shape[-1]]
        return self.pointwise(torch.nn.functional.silu(y))


class NamedPadding(nn.Module):
    """EfficientNet's convolutions: padding by name, "same" with a dilated odd kernel,
    then "valid" (1-D too), and a grouped "same" one."""

    def __init__(self):
        super().__init__()
        self.same = nn.Conv2d(4, 16, kernel_size=(3, 5), dilation=(2, 1), padding="same")
        self.valid = nn.Conv2d(16, 8, kernel_size=3, padding="valid", bias=False)
        self.grouped = nn.Conv1d(8, 8, kernel_size=3, padding="same", groups=4)

    def forward(self, x):
        y = self.valid(torch.relu(self.same(x)))  # [B, 8, 6, 6]
        return self.grouped(y.flatten(2))


class Pools(nn.Module):
    """ResNet's, PoolFormer's and Swin's pools between convolutions: over space only."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(4, 16, kernel_size=3, padding=1)
        self.mix = nn.Conv2d(16, 16, kernel_size=1)

    def forward(self, x):
        y = nn.functional.max_pool2d(torch.relu(self.stem(x)), 3, stride=2, padding=1)
        y = self.mix(y - nn.functional.avg_pool2d(y, 3, stride=1, padding=1))  # [B, 16, 4, 4]
        pooled = nn.functional.adaptive_avg_pool2d(y, 2).flatten(1)  # [B, 64]
        return pooled * nn.functional.adaptive_avg_pool1d(y.flatten(2), 1).repeat(1, 4, 1)[..., 0]


def conv2d():
    return Conv2d(), (torch.randn(8, 4, 8, 8),)


def pools():
    return Pools(), (torch.randn(8, 4, 8, 8),)


def named_padding():
    return NamedPadding(), (torch.randn(8, 4, 8, 8),)


def conv1d():
    return Conv1d(), (torch.randn(8, 16, 12),)


class TransposedWeights(nn.Module):
    """Falcon's layers: ``x @ weight.T``, an in-place residual add, a constant made in
    forward, and a reshape by example."""

    def __init__(self, hidden=16):
        super().__init__()
        self.up = nn.Parameter(torch.randn(32, hidden) / 4)
        self.down = nn.Parameter(torch.randn(hidden, 32) / 4)

    def forward(self, x):
        h = torch.tanh(x @ self.up.T) @ self.down.T
        h.add_(x * torch.tensor(0.5))
        return h.reshape(-1, h.shape[-1]).reshape_as(x)


class Elementwise(nn.Module):
    """Tables and masks as rotary embeddings, relative positions and ALiBi build them."""

    def __init__(self, hidden=16):
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)
        self.gate = nn.Linear(hidden, hidden)

    def forward(self, x):
        h = self.proj(x)  # [B, S, H]
        g = self.gate(x)
        pair = torch.stack([h, g], dim=-1).flatten(-2)  # [B, S, 2H]
        twice = torch.repeat_interleave(h, 2, dim=-1)  # [B, S, 2H]
        tiled = g.repeat(1, 1, 2)  # [B, S, 2H]
        mixed = pair * twice + torch.roll(tiled, shifts=1, dims=1)
        mixed = torch.where(mixed > 0, mixed, -1.0)
        mixed = torch.min(mixed, torch.full_like(mixed, 2.0))
        powered = torch.pow(torch.sigmoid(h) + 1, torch.sigmoid(g))
        soft = torch.nn.functional.softplus(g, beta=2.0, threshold=1.0)
        best = torch.argmax(mixed, dim=-1, keepdim=True)
        picked = torch.gather(mixed, -1, best)
        return mixed.sum(-1, keepdim=True) + torch.multiply(powered, soft) + picked


class Alibi(nn.Module):
    """Bloom's scores: ``baddbmm(alibi, q, kᵀ, beta=1, alpha=1/√d)``, then a softmax."""

    def __init__(self, hidden=16, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2).reshape(b * self.heads, s, -1) for t in (q, k, v))
        slopes = torch.arange(1, b * self.heads + 1, dtype=x.dtype).view(-1, 1, 1) / 8
        alibi = slopes * torch.arange(s, dtype=x.dtype).view(1, 1, s)
        scores = torch.baddbmm(alibi, q, k.transpose(1, 2), beta=0.5, alpha=0.25)
        attn = torch.softmax(scores, dim=-1) @ v  # [B·heads, S, d]
        attn = attn.view(b, self.heads, s, -1).transpose(1, 2).reshape(b, s, h)
        return self.out(attn)


def transposed_weights():
    return TransposedWeights(), (torch.randn(8, 4, 16),)


class InPlaceActivations(nn.Module):
    """ResNet's ``nn.ReLU(inplace=True)``, a clamp written in place, and two in-place
    updates in a row."""

    def __init__(self, hidden=16):
        super().__init__()
        self.up = nn.Linear(hidden, 32)
        self.act = nn.ReLU(inplace=True)
        self.down = nn.Linear(32, hidden)

    def forward(self, x):
        h = self.act(self.up(x)) * 2  # relu's backward reads its output: update a copy
        h.clamp_(max=2.0)
        h.add_(1.0)
        h.mul_(0.5)
        return torch.sigmoid_(self.down(h))


class UpdatedCopies(nn.Module):
    """In-place updates of what ``Tensor.to`` returns where it is a fresh tensor (a copy
    asked for, or a cast): the tensor it was made from keeps its values."""

    def __init__(self, hidden=16):
        super().__init__()
        self.up = nn.Linear(hidden, hidden)

    def forward(self, x):
        h = self.up(x)
        copied = h.to(h.device, copy=True)
        copied.mul_(2)
        cast = h.to(torch.float64)
        cast.add_(1)
        recast = h.to(torch.float32, copy=True)
        recast.sub_(1)
        return h * copied + cast.float() * recast


class UpdatedView(nn.Module):
    """An in-place update through a view of an activation that nothing reads after it
    but through that view (Funnel's relative attention: ``attn = shifted[..., :n];
    attn *= mask``): the update reaches no other tensor."""

    def __init__(self, hidden=16):
        super().__init__()
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(hidden, hidden)

    def forward(self, x):
        h = self.up(x)
        kept = h.unflatten(-1, (2, -1))[..., 1, :]  # a view of a view of h
        kept *= torch.sigmoid(x)
        return self.down(kept)


def updated_view():
    return UpdatedView(), (torch.randn(8, 4, 16),)


def updated_copies():
    return UpdatedCopies(), (torch.randn(8, 4, 16),)


def in_place_activations():
    return InPlaceActivations(), (torch.randn(8, 4, 16),)


class Regions(nn.Module):
    """Blocks torch.export wraps in higher-order ops: a stop-gradient scale computed under
    torch.no_grad(), and a softmax under a disabled autocast."""

    def __init__(self, hidden=16):
        super().__init__()
        self.up = nn.Linear(hidden, 32)
        self.down = nn.Linear(32, hidden)

    def forward(self, x):
        h = self.up(x)
        with torch.no_grad():
            scale = h.abs().mean(-1, keepdim=True) + 1.0
        with torch.autocast("cpu", enabled=False):
            h = (h / scale).softmax(-1)
        return self.down(h)


def regions():
    return Regions(), (torch.randn(8, 4, 16),)


class SpectralNorm(nn.Module):
    """A spectrally normalized linear: each forward's power iteration runs under
    torch.no_grad() on the weight and writes its vectors into buffers (``out=``)."""

    def __init__(self, hidden=16):
        super().__init__()
        self.up = nn.utils.parametrizations.spectral_norm(nn.Linear(hidden, 32))
        self.down = nn.Linear(32, hidden)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def spectral_norm():
    return SpectralNorm(), (torch.randn(8, 4, 16),)


class TensorInForward(nn.Module):
    """A constant made in forward from a NumPy array on its input's device (BigBird's
    random blocks): traced as a copy to the device, detached in place."""

    def __init__(self, hidden=16):
        super().__init__()
        self.up = nn.Linear(hidden, 32)
        self.down = nn.Linear(32, hidden)

    def forward(self, x):
        scale = torch.tensor(np.linspace(0.5, 1.5, 32), device=x.device, dtype=x.dtype)
        return self.down(torch.relu(self.up(x)) * scale)


def tensor_in_forward():
    return TensorInForward(), (torch.randn(8, 4, 16),)


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Cube(torch.autograd.Function):
    """A backward that is the forward's derivative, written by hand."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return scale * x**3

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 3 * ctx.scale * x**2 * grad, None


class Branching(nn.Module):
    """torch.cond, or a custom autograd Function: a straight-through rounding (its
    backward is not its forward's derivative) or an exact cube."""

    def __init__(self, kind: str, hidden=16):
        super().__init__()
        self.kind = kind
        self.up = nn.Linear(hidden, hidden)
        self.down = nn.Linear(hidden, hidden)

    def forward(self, x):
        h = self.up(x)
        if self.kind == "cond":
            return torch.cond(h.sum() > 0, lambda t: t * 2, lambda t: t - 1, (h,))
        if self.kind == "straight_through":
            return _StraightThrough.apply(h)
        return self.down(_Cube.apply(h, 0.5))


def cond_branch():
    return Branching("cond"), (torch.randn(8, 4, 16),)


def straight_through():
    return Branching("straight_through"), (torch.randn(8, 4, 16),)


def exact_function():
    return Branching("exact"), (torch.randn(8, 4, 16),)


def elementwise():
    return Elementwise(), (torch.randn(8, 4, 16),)


def alibi():
    return Alibi(), (torch.randn(8, 4, 16),)


class Experts(nn.Module):
    """Hugging Face's expert MLP: tokens sorted by expert through two grouped products."""

    def __init__(self, experts=4, hidden=16, inner=32):
        super().__init__()
        import transformers.integrations.moe  # noqa: F401  (registers grouped_mm_fallback)

        self.up = nn.Parameter(torch.randn(experts, inner, hidden) / 4)
        self.down = nn.Parameter(torch.randn(experts, hidden, inner) / 4)
        self.register_buffer("offs", torch.tensor([5, 5, 12, 16]))  # expert 1 gets no token

    def forward(self, x):
        grouped = torch.ops.transformers.grouped_mm_fallback
        h = torch.nn.functional.silu(grouped(x, self.up.transpose(1, 2), self.offs))
        return grouped(h, self.down.transpose(1, 2), self.offs)


def experts():
    return Experts(), (torch.randn(16, 16),)


class LookupThenLayer(nn.Module):
    """An embedding (feature-parallel under "3d") and a linear after it."""

    def __init__(self, vocab=32, hidden=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layer = nn.Linear(hidden, hidden)

    def forward(self, ids):
        return self.layer(self.embed(ids))


def lookup_then_layer():
    return LookupThenLayer(), (torch.randint(0, 32, (8, 4)),)


class TiedHead(nn.Module):
    """A lookup whose table the output projection reads too (tied weights)."""

    def __init__(self, vocab=16, hidden=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.mid = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.embed(ids))))


def tied_head():
    return TiedHead(), (torch.randint(0, 16, (8, 8)),)


class LayerOnAChunk(nn.Module):
    """A layer reading one piece of a chunk (ProphetNet's decoder: its main stream is a
    chunk of the hidden states): the piece is a getitem, stored as the chunk's output."""

    def __init__(self, hidden=32):
        super().__init__()
        self.up = nn.Linear(hidden, hidden)
        self.layer = nn.Linear(hidden, hidden)

    def forward(self, x):
        first, second = self.up(x).chunk(2, dim=1)
        return self.layer(first) + second


def layer_on_a_chunk():
    return LayerOnAChunk(), (torch.randn(4, 16, 32),)


class UpdatedBetweenReaders(nn.Module):
    """A replicated tensor read by two nodes that convert it alike, and updated in place
    between them by an op no rule claims (``m[:, 0] = 3``): the second reads the update."""

    def __init__(self, hidden=16):
        super().__init__()
        self.up = nn.Linear(hidden, hidden)
        self.down = nn.Linear(hidden, hidden)

    def forward(self, x):
        h = self.up(x)
        m = torch.ones(x.shape)
        before = h + m
        m[:, 0] = 3.0
        return self.down(before + (h + m))


def updated_between_readers():
    return UpdatedBetweenReaders(), (torch.randn(8, 4, 16),)


class FilledInPlaceReadThroughItsResult(nn.Module):
    """An update in place by an op no rule claims, of an activation read after it only
    through the update's result: run replicated on a gathered copy, it is still right."""

    def __init__(self, hidden=16):
        super().__init__()
        self.up = nn.Linear(hidden, hidden)
        self.down = nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.down(self.up(x).index_fill_(-1, torch.tensor([0, 3]), 0.0))


def filled_in_place():
    return FilledInPlaceReadThroughItsResult(), (torch.randn(8, 4, 16),)


class IndexBuiltInPlace(nn.Module):
    """BEiT's relative position index: built in forward from aranges, its columns
    updated in place through views and the whole read after, then used to look up a
    table of biases. It is made of no input: every rank builds it alike, in place."""

    def __init__(self, size=4, hidden=16):
        super().__init__()
        self.table = nn.Parameter(torch.randn(4 * size * size, 1))
        self.proj = nn.Linear(hidden, hidden)
        self.size = size

    def forward(self, x):
        n = self.size
        coords = torch.arange(n)[:, None] - torch.arange(n)[None, :]
        coords = torch.stack([coords, coords.t()], -1).contiguous()
        coords[:, :, 0] += n - 1
        coords[:, :, 1] += n - 1
        coords[:, :, 0] *= 2 * n - 1
        bias = self.table[coords.sum(-1).view(-1)].view(n, n)
        return self.proj(x).unflatten(-1, (n, n)) + bias


def index_built_in_place():
    return IndexBuiltInPlace(), (torch.randn(8, 4, 16),)


class AveragedBuffers(nn.Module):
    """Buffers updated in forward: an exponential average by two updates in a row
    (the second updates the first's result, which is the buffer), the same under
    ``torch.no_grad()`` (which reaches the buffer through a ``detach``), and a copy
    into a buffer (an op no rule claims)."""

    def __init__(self, hidden=16):
        super().__init__()
        self.up = nn.Linear(hidden, hidden)
        self.down = nn.Linear(hidden, hidden)
        for name in ("ema", "ema_no_grad", "last"):
            self.register_buffer(name, torch.zeros(hidden))

    def forward(self, x):
        h = self.up(x)
        self.ema.mul_(0.9).add_(0.1 * h.detach().mean((0, 1)))
        with torch.no_grad():
            self.ema_no_grad.mul_(0.5).add_(0.5 * h.mean((0, 1)))
            self.last.copy_(h.mean((0, 1)))
        return self.down(h * self.ema + self.ema_no_grad - self.last)


def averaged_buffers():
    return AveragedBuffers(), (torch.randn(8, 4, 16),)


class Einsums(nn.Module):
    """Attention written as einsums, as XLNet and Funnel write it: projections by 3-D
    weights (``ibh,hnd->ibnd``), scores and context between activations, and a layer
    by a 2-D weight indexed the other way round (``hd,bld->blh``)."""

    def __init__(self, hidden=16, heads=4):
        super().__init__()
        self.q = nn.Parameter(torch.randn(hidden, heads, hidden // heads) / hidden**0.5)
        self.k = nn.Parameter(torch.randn(hidden, heads, hidden // heads) / hidden**0.5)
        self.o = nn.Parameter(torch.randn(hidden, heads, hidden // heads) / hidden**0.5)
        self.up = nn.Parameter(torch.randn(2 * hidden, hidden) / hidden**0.5)
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        q = torch.einsum("ibh,hnd->ibnd", x, self.q)
        k = torch.einsum("ibh,hnd->ibnd", x, self.k)
        scores = torch.einsum("ibnd,jbnd->bnij", q, k).softmax(-1)
        context = torch.einsum("bnij,jbnd->ibnd", scores, q)
        h = x + torch.einsum("ibnd,hnd->ibh", context, self.o)
        return self.down(torch.relu(torch.einsum("fh,ibh->ibf", self.up, h)))


def einsums():
    return Einsums(), (torch.randn(8, 4, 16),)


class FilledFromLayers(nn.Module):
    """A buffer made in forward, filled from layers through slices of it, then read as a
    whole: ``out = zeros(…); out[:, :h] = a(x); out[:, h:] += b(x)``. From the first
    update on, it needs the gradient the layers' outputs need."""

    def __init__(self, hidden=16):
        super().__init__()
        self.a = nn.Linear(hidden, hidden)
        self.b = nn.Linear(hidden, hidden)
        self.out = nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        out = torch.zeros(*x.shape[:-1], 2 * x.shape[-1])
        out[..., : x.shape[-1]] = self.a(x)
        out[..., x.shape[-1] :] += self.b(x)
        return self.out(out)


def filled_from_layers():
    return FilledFromLayers(), (torch.randn(8, 4, 16),)


class GroupedQueryAttention(nn.Module):
    """Eight query heads over two key/value heads, as ``scaled_dot_product_attention(...,
    enable_gqa=True)`` takes them (Hugging Face's sdpa attention, without repeating the
    key and value heads): query head i reads key head i // 4."""

    def __init__(self, hidden=32, heads=8, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q = nn.Linear(hidden, hidden)
        self.kv = nn.Linear(hidden, 2 * kv_heads * self.head_dim)
        self.o = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2 * self.kv_heads, self.head_dim).transpose(1, 2).chunk(2, 1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


def grouped_query_attention():
    return GroupedQueryAttention(), (torch.randn(4, 8, 32),)


class UpdatesItsInput(nn.Module):
    """Doubles its input in place, which the caller sees."""

    def __init__(self, hidden=16):
        super().__init__()
        self.up = nn.Linear(hidden, 2 * hidden)

    def forward(self, x):
        x.mul_(2)
        return self.up(x)


def updates_its_input():
    return UpdatesItsInput(), (torch.randn(8, 4, 16),)


class CountsSteps(nn.Module):
    """A 0-d buffer counted up in place in forward and read by a product that saves it
    for backward (torch.export writes the buffer back with a copy into itself)."""

    def __init__(self, hidden=16):
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        self.steps += 1
        return self.proj(x) * self.steps


def counts_steps():
    return CountsSteps(), (torch.randn(8, 4, 16),)


class Along(nn.Module):
    """Ops that work along a dim and need it whole: a hand-written norm by variance, a
    stable softmax by amax, logsumexp, std, prod, a cumulative product and log-sum,
    a flip, rows selected by an index, and any/all masks, along features and along
    the sequence."""

    def __init__(self, hidden=16):
        super().__init__()
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        h = self.up(x)
        h = (h - h.mean(-1, keepdim=True)) / (h.var(-1, keepdim=True, correction=0) + 1e-5).sqrt()
        e = (h - h.amax(-1, keepdim=True)).exp()
        h = e / e.sum(-1, keepdim=True) + h.std(1, keepdim=True) - h.logsumexp(-1, keepdim=True)
        h = h + torch.sigmoid(h).cumprod(1) + h.logcumsumexp(1) + h.flip(1)
        h = h + torch.sigmoid(h[..., :4]).prod(-1, keepdim=True)
        h = h + h.index_select(1, torch.arange(h.shape[1] - 1, -1, -1))
        h = h + h.mean().cumprod(0) + h.sum().amax(0) * 1e-3 + h.flip([])  # 0-d, no dims
        keep = (h > -50).all(-1, keepdim=True) & (h < 50).any(1, keepdim=True)
        return self.down(torch.where(keep, h, 0.0) + h.amin(1, keepdim=True))


def along():
    return Along(), (torch.randn(8, 4, 16),)


class Norms(nn.Module):
    """torch's RMS norm (with and without a weight), then group and instance norms
    over channels [B, C, S], and an instance norm that tracks running statistics."""

    def __init__(self, hidden=16):
        super().__init__()
        self.up = nn.Linear(hidden, hidden)
        self.rms = nn.RMSNorm(hidden)
        self.bare_rms = nn.RMSNorm(hidden, elementwise_affine=False)
        self.groups = nn.GroupNorm(4, hidden)
        self.instances = nn.InstanceNorm1d(hidden, affine=True)
        self.tracked = nn.InstanceNorm1d(hidden, affine=True, track_running_stats=True)
        self.down = nn.Linear(hidden, hidden)

    def forward(self, x):
        h = self.bare_rms(self.rms(self.up(x))).transpose(1, 2)
        h = self.tracked(self.instances(self.groups(h)))
        return self.down(h.transpose(1, 2))


def norms():
    return Norms(), (torch.randn(8, 4, 16),)


def norms_eval():
    model, inputs = norms()
    return model.eval(), inputs


class BatchNorms(nn.Module):
    """Batch norms over [B, C, H, W] (affine and tracking running statistics; neither)
    and over [B, C], their statistics and running statistics set away from 0 and 1."""

    def __init__(self, channels=8, hidden=16):
        super().__init__()
        self.conv = nn.Conv2d(4, channels, 3, padding=1)
        self.tracked = nn.BatchNorm2d(channels, momentum=0.3)
        self.conv_1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.untracked = nn.BatchNorm2d(channels, affine=False, track_running_stats=False)
        self.up = nn.Linear(channels * 16, hidden)
        self.flat = nn.BatchNorm1d(hidden)
        self.down = nn.Linear(hidden, hidden)
        with torch.no_grad():
            for norm in (self.tracked, self.flat):
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.uniform_(-0.5, 0.5)
                norm.running_mean.uniform_(-0.2, 0.2)
                norm.running_var.uniform_(0.5, 1.5)

    def forward(self, x):
        h = torch.relu(self.tracked(self.conv(x)))
        h = torch.relu(self.untracked(self.conv_1(h)))
        return self.down(self.flat(self.up(h.flatten(1))))


def batch_norms():
    return BatchNorms(), (torch.randn(8, 4, 4, 4) * 2 + 1,)


def batch_norms_eval():
    model, inputs = batch_norms()
    return model.eval(), inputs


class NormThenTokenMean(nn.Module):
    """Tokens made a map, a convolution and a batch norm over it, and the map made tokens
    again and averaged (CvT's projections): the norm's gradient arrives with
    channels-last strides."""

    def __init__(self, channels=32, classes=8):
        super().__init__()
        self.up = nn.Linear(channels, channels)
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(channels)
        self.out = nn.Linear(channels, classes)
        with torch.no_grad():
            self.norm.running_mean.uniform_(-0.5, 0.5)
            self.norm.running_var.uniform_(0.5, 2.0)

    def forward(self, x, labels):
        h = self.up(x)  # [B, 16 tokens, C]
        b, t, c = h.shape
        m = self.norm(self.conv(h.transpose(1, 2).reshape(b, c, 4, 4)))
        logits = self.out(m.flatten(2).transpose(1, 2).mean(1))
        return F.cross_entropy(logits, labels)


def norm_then_token_mean_eval():
    """In eval, 4 samples: one per rank where the batch splits over two axes."""
    return NormThenTokenMean().eval(), (torch.randn(4, 16, 32), torch.arange(4))


class AttentionOfAnyRank(nn.Module):
    """Attention over [B, S, E] (no heads dim), with a boolean mask, and over
    [B, G, H, S, D] (two leading dims besides the batch), causal."""

    def __init__(self, hidden=16):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, e = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        q, k, v = (t.view(b, s, 2, 2, e // 4).permute(0, 2, 3, 1, 4) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(h + o.permute(0, 3, 1, 2, 4).reshape(b, s, e))


def attention_of_any_rank():
    return AttentionOfAnyRank(), (torch.randn(4, 6, 16),)


class NormOverEveryDim(nn.Module):
    """A layer norm over every dim of its input (no rows left): its weight's gradient
    sums over none."""

    def __init__(self, hidden=16):
        super().__init__()
        self.up, self.down = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm((4, 6, hidden))

    def forward(self, x):
        return self.down(self.norm(self.up(x)))


def norm_over_every_dim():
    return NormOverEveryDim(), (torch.randn(4, 6, 16),)


class BiasesPerRow(nn.Module):
    """``addmm`` and ``linear`` with a bias per row ([M, N] and [M, 1]), which they
    broadcast as any other operand, with one row ([1, N]) and with one number; and
    ``addmm`` of activations."""

    def __init__(self, rows=8, hidden=16):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden, hidden) / 4)
        self.per_row = nn.Parameter(torch.randn(rows, hidden))
        self.per_row_1 = nn.Parameter(torch.randn(rows, 1))
        self.one_row = nn.Parameter(torch.randn(1, hidden))
        self.scalar = nn.Parameter(torch.randn(()))
        self.down = nn.Linear(hidden, hidden)

    def forward(self, x):
        h = torch.addmm(self.per_row, x, self.weight)
        h = F.linear(torch.relu(h), self.weight, self.per_row_1)
        h = torch.addmm(self.one_row, h, self.weight) + torch.addmm(self.scalar, h, self.weight)
        return self.down(torch.addmm(h, h[:, :8], self.down(h)[:8]))  # of activations


def biases_per_row():
    return BiasesPerRow(), (torch.randn(8, 16),)


class PointwiseLosses(nn.Module):
    """Losses computed element by element, every reduction: mean squared error
    (mean), L1 (sum), Huber (none, then a mean), binary cross-entropy with a weight
    per feature, with logits and a positive weight per feature, KL divergence
    ("batchmean": a sum, then a division, and of a learned prior smaller than its
    target, which kl_div broadcasts itself), soft margin against a broadcast target."""

    def __init__(self, hidden=16):
        super().__init__()
        self.up, self.head = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)
        self.register_buffer("weight", torch.linspace(0.5, 2.0, hidden))
        self.prior = nn.Parameter(torch.randn(hidden))  # smaller than kl_div's target

    def forward(self, x, target):
        h = self.head(torch.relu(self.up(x)))
        p, q = target.sigmoid(), target.softmax(-1)
        return (
            F.mse_loss(h, target)
            + F.l1_loss(h, target, reduction="sum") / 100
            + F.huber_loss(h, target, reduction="none", delta=0.5).mean()
            + F.binary_cross_entropy(h.sigmoid(), p, weight=self.weight)
            + F.binary_cross_entropy_with_logits(h, p, pos_weight=self.weight)
            + F.kl_div(h.log_softmax(-1), q, reduction="batchmean")
            + F.soft_margin_loss(h, target[:1].sign().expand_as(h))
            + F.kl_div(self.prior.log_softmax(-1), h.softmax(-1), reduction="sum") / 32
        )


def pointwise_losses():
    return PointwiseLosses(), (torch.randn(4, 8, 16), torch.randn(4, 8, 16))


class ClassLosses(nn.Module):
    """Cross-entropy and negative log-likelihood with the arguments torch takes: per-class
    weights, label smoothing (with weights too), an `ignore_index` the targets hit,
    every reduction, class probabilities as targets (given, and learned: needing a
    gradient); over [rows, classes] scores, [N, classes, d] (the class dim inside, as
    a segmentation's) and [classes] with a 0-d target. Losses kept per row are weighted
    unevenly, so each row's gradient counts."""

    def __init__(self, hidden=16, classes=8):
        super().__init__()
        self.up, self.head = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, classes)
        self.teacher = nn.Linear(hidden, classes)
        self.register_buffer("weight", torch.linspace(0.5, 2.0, classes))

    def forward(self, x, target, probs):
        logits = self.head(torch.relu(self.up(x)))  # [4, 8, classes]
        rows, flat, w = logits.flatten(0, 1), target.flatten(), self.weight
        inside = logits.transpose(1, 2)  # [4, classes, 8]
        ramp = torch.arange(flat.numel()) / flat.numel()
        learned = torch.sigmoid(self.teacher(x)).flatten(0, 1)
        ce, nll, log_p = F.cross_entropy, F.nll_loss, rows.log_softmax(-1)  # classes whole
        return (
            ce(rows, flat, weight=w, ignore_index=3)
            + ce(rows, flat, weight=w, label_smoothing=0.2, ignore_index=3)
            + ce(rows, flat, label_smoothing=0.1, reduction="sum") / 32
            + (ce(rows, flat, weight=w, reduction="none", ignore_index=3) * ramp).sum()
            + ce(inside, target, weight=w, label_smoothing=0.1)
            + ce(logits[0, 0], target[0, 0])
            + nll(F.logsigmoid(rows), flat, weight=w, ignore_index=3)
            + nll(log_p, flat, reduction="sum") / 32
            + (nll(F.logsigmoid(inside), target, reduction="none") ** 2).mean()
            + ce(rows, probs.flatten(0, 1), weight=w, label_smoothing=0.1)
            + (ce(inside, probs.transpose(1, 2), reduction="none") * ramp.view(4, 8)).sum()
            + ce(rows, learned, reduction="sum") / 32
        )


def class_losses():
    generator = torch.Generator().manual_seed(0)
    target = torch.randint(0, 8, (4, 8), generator=generator)
    target[:, ::3] = 3  # ignored where the loss says so
    probs = torch.randn(4, 8, 8, generator=generator).softmax(-1)
    return ClassLosses(), (torch.randn(4, 8, 16, generator=generator), target, probs)


class UpAndDown(nn.Module):
    """Down by strided convolutions, up by transposed ones (as a U-Net's decoder): with a
    stride and an output_padding, in groups without a bias, with a dilation, and 1-D."""

    def __init__(self, c=8):
        super().__init__()
        self.down1 = nn.Conv2d(3, c, 3, stride=2, padding=1)
        self.down2 = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1)
        self.up2 = nn.ConvTranspose2d(2 * c, c, 3, stride=2, padding=1, output_padding=1)
        self.up1 = nn.ConvTranspose2d(2 * c, c, 4, stride=2, padding=1, groups=2, bias=False)
        self.head = nn.ConvTranspose2d(c, 4, 3, padding=2, dilation=2)
        self.line = nn.ConvTranspose1d(4, 4, 2, stride=2)

    def forward(self, x):
        d1 = F.gelu(self.down1(x))
        u2 = F.gelu(self.up2(F.gelu(self.down2(d1))))
        y = self.head(F.gelu(self.up1(torch.cat([u2, d1], 1))))
        z = self.line(y.flatten(2)[..., :8])
        return y.square().mean() + z.square().mean()


def up_and_down():
    return UpAndDown(), (torch.randn(8, 3, 16, 16),)


class FourierMixing(nn.Module):
    """Layers whose gradient flows back through complex values: FNet's mixing (the real
    part of a 2-D FFT over tokens and features), an rfft and its inverse over tokens,
    and the magnitude of an FFT over features (the FFTs themselves run replicated)."""

    def __init__(self, d=32):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        h = self.a(x)
        mixed = torch.fft.fftn(h, dim=(1, 2)).real
        smooth = torch.fft.irfft(torch.fft.rfft(h, dim=1), n=h.shape[1], dim=1)
        magnitude = torch.fft.fft(h, dim=-1).abs()
        return self.b(mixed + smooth + magnitude).square().mean()


def fourier_mixing():
    return FourierMixing(), (torch.randn(8, 8, 32),)


class RandomOnTransposed(nn.Module):
    """Random ops with no rule (they run replicated) on transposed activations: torch
    draws their numbers in the memory order of a tensor like their input, which a
    gathered operand is not laid out as: alpha and feature-alpha dropout, randn_like.
    (Not rand_like, nor bernoulli with a tensor of probabilities: float64 draws other
    numbers for them, so the float64 run would be no reference.)"""

    def __init__(self, hidden=16, tokens=8):
        super().__init__()
        self.a = nn.Linear(hidden, hidden)
        self.b = nn.Linear(tokens, hidden)

    def forward(self, x):
        t = self.a(x).transpose(1, 2)  # [batch, hidden, tokens]: a view, not row-major
        noisy = F.alpha_dropout(t, 0.2, training=True) + F.feature_alpha_dropout(t, 0.3, True)
        return self.b(noisy + torch.randn_like(t))


class BlockAppliedTwice(nn.Module):
    """One block applied twice on the residual stream, `h = h + blk(h)` in a loop (a
    weight-shared recurrence): each of its layers is one unit read twice, with the
    residual sum between its two readings."""

    def __init__(self, hidden=32):
        super().__init__()
        self.blk = nn.Sequential(
            nn.LayerNorm(hidden),
            nn.Linear(hidden, 2 * hidden),
            nn.GELU(),
            nn.Linear(2 * hidden, hidden),
        )

    def forward(self, x):
        h = x
        for _ in range(2):
            h = h + self.blk(h)
        return h


def block_applied_twice():
    return BlockAppliedTwice(), (torch.randn(8, 8, 32),)


class GatedBlock(nn.Module):
    """A gated MLP without biases beside a plain linear: four weights a 3D plan gathers
    over one axis, in one gather bucket."""

    def __init__(self, hidden):
        super().__init__()
        self.up = nn.Linear(hidden, 4 * hidden, bias=False)
        self.gate = nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = nn.Linear(4 * hidden, hidden, bias=False)
        self.side = nn.Linear(hidden, hidden)

    def forward(self, x):
        return x + self.down(F.silu(self.gate(x)) * self.up(x)) + self.side(x)


class GatedBlocks(nn.Module):
    def __init__(self, hidden=64, layers=2):
        super().__init__()
        self.inp = nn.Linear(hidden, hidden, bias=False)
        self.blocks = nn.ModuleList(GatedBlock(hidden) for _ in range(layers))
        self.out = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def gated_blocks():
    return GatedBlocks(), (torch.randn(4, 4, 64),)


class RenormedEmbedding(nn.Module):
    """An embedding with `max_norm`: each forward renormalizes the rows it looks up, in
    place, in the weight itself."""

    def __init__(self, vocab=64, hidden=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden, max_norm=1.0)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, ids):
        return self.out(self.embed(ids)).tanh()


def renormed_embedding():
    return RenormedEmbedding(), (torch.randint(0, 64, (8, 8)),)


def random_on_transposed():
    return RandomOnTransposed(hidden=32), (torch.randn(8, 8, 32),)


class TensorSplits(nn.Module):
    """``tensor_split`` into sections along features, and by indices along tokens."""

    def __init__(self, hidden=16):
        super().__init__()
        self.up, self.down = nn.Linear(hidden, 2 * hidden), nn.Linear(hidden, hidden)

    def forward(self, x):
        a, b = self.up(x).tensor_split(2, dim=-1)
        first, second = a.tensor_split([3], dim=1)
        return self.down(torch.cat([second, first], 1) * b)


def tensor_splits():
    return TensorSplits(), (torch.randn(4, 8, 16),)


class Activations(nn.Module):
    """torch.nn's activations, each between two layers, with their arguments set:
    ELU, CELU, SELU, LeakyReLU, Hardtanh and ReLU6, Hardswish, Hardsigmoid,
    LogSigmoid, Mish, Softshrink, Hardshrink, Threshold; PReLU with one slope per
    channel over [B, C, L] and [B, C], and with one slope; GLU along features."""

    def __init__(self, hidden=16):
        super().__init__()
        self.up = nn.Linear(hidden, hidden)
        self.pointwise = nn.Sequential(
            nn.ELU(alpha=0.7),
            nn.CELU(alpha=1.3),
            nn.SELU(),
            nn.LeakyReLU(0.2),
            nn.Hardtanh(-2.0, 1.5),
            nn.ReLU6(),
            nn.Hardswish(),
            nn.Hardsigmoid(),
            nn.LogSigmoid(),
            nn.Mish(),
            nn.Softshrink(0.1),
            nn.Hardshrink(0.05),
            nn.Threshold(-0.5, 0.25),
        )
        self.channels = nn.PReLU(4, init=0.1)
        self.features = nn.PReLU(hidden, init=0.3)
        self.one = nn.PReLU(init=0.2)
        self.glu = nn.GLU(-1)
        self.down = nn.Linear(hidden // 2, hidden)
        with torch.no_grad():
            for prelu in (self.channels, self.features):
                prelu.weight.uniform_(-0.5, 0.5)

    def forward(self, x):
        h = self.up(x)
        h = sum(act(h) for act in self.pointwise)
        h = self.features(self.channels(h).flatten(0, 1)).view(h.shape)
        return self.down(self.glu(self.one(h)))


def activations():
    return Activations(), (torch.randn(8, 4, 16),)


class Resizes(nn.Module):
    """F.interpolate in each mode (nearest, bilinear to a size, bicubic aligning
    corners, nearest-exact, linear over [B, C, L]) and an adaptive max pool with its
    indices."""

    def __init__(self, channels=8):
        super().__init__()
        self.conv = nn.Conv2d(4, channels, 1)
        self.conv_1 = nn.Conv1d(channels, channels, 1)
        self.head = nn.Linear(channels, channels)

    def forward(self, x):
        h = self.conv(x)
        h = (
            F.interpolate(h, scale_factor=2)
            + F.interpolate(h, size=(8, 16), mode="bilinear", align_corners=False)
            + F.interpolate(h, scale_factor=2, mode="bicubic", align_corners=True)
            + F.interpolate(h, scale_factor=2, mode="nearest-exact")
        )
        pooled, _ = F.adaptive_max_pool2d(h, (2, 4), return_indices=True)
        h = F.interpolate(self.conv_1(pooled.flatten(2)), scale_factor=3, mode="linear")
        return self.head(h.transpose(1, 2))


def resizes():
    return Resizes(), (torch.randn(8, 4, 4, 8),)


class MeanKeptWhole(nn.Module):
    """``h.mean(dim=None, keepdim=True)``: every dim reduced and kept, [1, 1, 1]."""

    def __init__(self, hidden=16):
        super().__init__()
        self.up, self.down = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, x):
        h = self.up(x)
        return self.down(h * h.mean(dim=None, keepdim=True)[0, 0]), h.mean(None, True)


def mean_kept_whole():
    return MeanKeptWhole(), (torch.randn(4, 6, 16),)


class Ranked(nn.Module):
    """Maxima and minima along a dim with their indices, a top k (a router's), sorts,
    a median, a k-th value, a mode, and norms of rows (F.normalize)."""

    def __init__(self, hidden=16):
        super().__init__()
        self.up, self.down = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, x):
        h = self.up(x)
        biggest, where = h.max(dim=-1, keepdim=True)
        smallest = h.min(dim=1).values.unsqueeze(1)
        top, chosen = h.topk(4, dim=-1)
        ranked, order = h.sort(dim=-1, descending=True)
        stable = h.sort(dim=1, stable=True).values
        median = h.median(dim=-1, keepdim=True).values
        kth = h.kthvalue(3, dim=-1, keepdim=True).values
        mode = h.round().mode(dim=-1, keepdim=True).values
        picked = top.softmax(-1).sum(-1, keepdim=True) * chosen.float().mean(-1, keepdim=True)
        h = (
            F.normalize(h, dim=-1) * torch.linalg.vector_norm(h, dim=1, keepdim=True)
            + picked
            + (biggest - smallest + median + kth + mode) * where.float() / 16
            + ranked * stable
            + order.argsort(dim=-1).float() / 16
        )
        return self.down(h)


def ranked():
    return Ranked(), (torch.randn(4, 6, 16),)


class OtherSpellings(nn.Module):
    """Ops that are other ops with other arguments (``x.mT``, ``movedim``, ``view_as``,
    ``tile``) and pointwise or along-a-dim ops users write: division with a rounding
    mode, clamps by tensors, ``addcmul``, ``lerp``, ``var_mean``, ``std_mean``,
    ``nansum``."""

    def __init__(self, hidden=16):
        super().__init__()
        self.up, self.down = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, x):
        h = self.up(x)
        scores = (h @ h.mT).softmax(-1) @ h
        moved = h.movedim(1, 0).exp().movedim(0, 1)
        tiled = h.tile((1, 2))[..., :16] + h.view_as(x)
        rounded = torch.div(h, 0.3, rounding_mode="floor") + torch.div(
            h, h.abs() + 2, rounding_mode="trunc"
        )
        clamped = torch.clamp(h, min=-h.detach().abs(), max=h.detach().abs() * 0.5)
        mixed = (
            torch.addcmul(h, h, moved, value=0.5)
            + torch.lerp(h, tiled, 0.3)
            + torch.lerp(h, scores, h.sigmoid())
        )
        var, mean = torch.var_mean(h, dim=-1, keepdim=True)
        std, mean_1 = torch.std_mean(h, dim=1, keepdim=True, correction=0)
        total = torch.nansum(h, dim=-1, keepdim=True)
        return self.down(mixed + rounded + clamped + var + mean + std + mean_1 + total / 16)


def other_spellings():
    return OtherSpellings(), (torch.randn(4, 6, 16),)


class DropoutInPlace(nn.Module):
    """``nn.Dropout(inplace=True)`` on a new tensor (a layer's activation), and on a view
    of one (its update must reach the viewed tensor: left in place)."""

    def __init__(self, hidden=16):
        super().__init__()
        self.up, self.down = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)
        self.drop = nn.Dropout(0.3, inplace=True)
        self.drop_view = nn.Dropout(0.2, inplace=True)

    def forward(self, x):
        h = self.drop(F.gelu(self.up(x)))
        rows = self.up(x).view(-1, h.shape[-1])
        return self.down(h) + self.down(self.drop_view(rows).view(h.shape))


def dropout_in_place():
    return DropoutInPlace(), (torch.randn(4, 6, 16),)


def dropout_in_place_eval():
    model, inputs = dropout_in_place()
    return model.eval(), inputs


class MaximumOfAScalar(nn.Module):
    """``max(dim=0)`` of a 0-d tensor: its values and index, both 0-d."""

    def __init__(self, hidden=16):
        super().__init__()
        self.up = nn.Linear(hidden, hidden)

    def forward(self, x):
        h = self.up(x)
        biggest, _ = h.square().mean().max(dim=0)
        return h * biggest


def maximum_of_a_scalar():
    return MaximumOfAScalar(), (torch.randn(4, 16),)


class FlattenedLayers(nn.Module):
    """Layers on tokens flattened around the product: GPT-2's Conv1D
    (``addmm(bias, x.view(-1, K), weight).view(B, S, N)``), one without a bias (``mm``),
    and an nn.Linear called on flattened tokens. Six sequences: three a rank after one
    axis of a 2×2×2 mesh, which the next axis does not divide."""

    def __init__(self, hidden=16):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up_weight = nn.Parameter(torch.randn(hidden, 4 * hidden) / hidden**0.5)
        self.up_bias = nn.Parameter(torch.randn(4 * hidden))
        self.down_weight = nn.Parameter(torch.randn(4 * hidden, hidden) / (4 * hidden) ** 0.5)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x):
        batch, seq, hidden = x.shape
        flat = self.norm(x).view(-1, hidden)
        up = torch.addmm(self.up_bias, flat, self.up_weight).view(batch, seq, -1)
        down = torch.mm(F.gelu(up).view(-1, up.shape[-1]), self.down_weight)
        x = x + down.view(batch, seq, hidden)
        return self.out(x.reshape(-1, hidden)).view(batch, seq, hidden)


def flattened_layers():
    return FlattenedLayers(), (torch.randn(6, 8, 16),)


class Slices(nn.Module):
    """Slices of one projection's features: three that cut it into consecutive pieces
    (the last by a negative start), and beside them, of another, two that overlap, one
    with a step and one that leaves a gap."""

    def __init__(self):
        super().__init__()
        self.fused = nn.Linear(16, 32)
        self.other = nn.Linear(16, 32)

    def forward(self, x):
        h, g = self.fused(x), self.other(x)
        q, k, v = h[..., :16], h[..., 16:24], h[..., -8:]
        overlapping = g[..., :20] * g[..., 12:]
        return q * torch.cat([k, v], -1) + overlapping[..., :16] + g[..., ::2] + g[..., 20:28].sum()


def slices():
    return Slices(), (torch.randn(4, 8, 16),)


class FlattenedLoss(nn.Module):
    """A language model's loss as Hugging Face writes it: the logits cast to fp32 and
    flattened, the shifted labels (padding ids -100) flattened and cast, one
    cross-entropy (with label smoothing, averaged) and one summed. Six sequences of
    eight tokens: three a rank after one axis of 2×2×2."""

    def __init__(self, vocab=32, hidden=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.embed(ids))).float()
        shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
        flat, targets = logits.view(-1, logits.shape[-1]), shifted.view(-1).to(ids.device)
        mean = F.cross_entropy(flat, targets, ignore_index=-100, label_smoothing=0.1)
        return mean + F.cross_entropy(flat, targets, reduction="sum") / 100


def flattened_loss():
    ids = torch.randint(0, 32, (6, 8))
    labels = ids.clone()
    labels[1, -3:] = -100  # padding
    return FlattenedLoss(), (ids, labels)
