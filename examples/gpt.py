"""A GPT-2 language model in the style of nanoGPT, returning its training loss.

autoshard show examples/gpt.py:gpt_12l --mesh 2x2x2
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    vocab: int = 64
    seq: int = 8
    d_model: int = 32
    n_head: int = 4
    n_layer: int = 2
    dropout: float = 0.0
    explicit_attention: bool = False  # q @ k^T, mask, softmax, @ v instead of SDPA


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.d_model % cfg.n_head == 0
        self.n_head, self.head_dim = cfg.n_head, cfg.d_model // cfg.n_head
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj.residual_projection = True
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)
        self.dropout = cfg.dropout
        self.explicit = cfg.explicit_attention
        if self.explicit:
            self.seq = cfg.seq
            self.register_buffer("mask", self._causal_mask(), persistent=False)

    def _causal_mask(self) -> torch.Tensor:
        return torch.ones(self.seq, self.seq).tril().view(1, 1, self.seq, self.seq)

    def reset_parameters(self) -> None:
        """Recompute the mask (what a model built on meta lacks)."""
        if self.explicit:
            with torch.no_grad():
                self.mask.copy_(self._causal_mask())

    def forward(self, x):
        B, T, C = x.shape
        q = self.q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        if self.explicit:
            att = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(self.head_dim))
            att = att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf"))
            y = self.attn_drop(F.softmax(att, dim=-1)) @ v
        else:
            dropout_p = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.gelu = nn.GELU(approximate="tanh")
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.proj.residual_projection = True
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.drop(self.proj(self.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        self.apply(self._init_weights)

    def _init_weights(self, module):
        """nanoGPT's init, one module at a time (so `init_weights` can replay it); the
        projections into the residual stream are scaled down with depth."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            residual = getattr(module, "residual_projection", False)
            std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if residual else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets):
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _tokens(batch: int, seq: int, vocab: int):
    idx = torch.randint(0, vocab, (batch, seq))
    targets = torch.randint(0, vocab, (batch, seq))
    return idx, targets


def gpt(
    batch: int = 4,
    seq: int = 8,
    vocab: int = 64,
    d_model: int = 32,
    n_head: int = 4,
    n_layer: int = 2,
    dropout: float = 0.0,
    explicit_attention: bool = False,
):
    """A small GPT for tests: (model, (idx, targets))."""
    cfg = GPTConfig(vocab, seq, d_model, n_head, n_layer, dropout, explicit_attention)
    return GPT(cfg), _tokens(batch, seq, vocab)


def gpt_explicit(
    batch: int = 4,
    seq: int = 8,
    vocab: int = 64,
    d_model: int = 32,
    n_head: int = 4,
    n_layer: int = 2,
    dropout: float = 0.0,
):
    """`gpt` with attention written out as matmul, causal mask and softmax."""
    return gpt(batch, seq, vocab, d_model, n_head, n_layer, dropout, explicit_attention=True)


def gpt_12l(
    batch: int = 8,
    seq: int = 128,
    vocab: int = 512,
    d_model: int = 256,
    n_head: int = 8,
    n_layer: int = 12,
):
    """A 12-layer GPT for `autoshard show` and benchmarks."""
    return gpt(batch, seq, vocab, d_model, n_head, n_layer)


def gpt_layers(
    n_layer: int = 4,
    d_model: int = 1024,
    n_head: int = 16,
    seq: int = 128,
    batch: int = 8,
    vocab: int = 1024,
):
    """A wide GPT whose depth is the benchmark parameter."""
    return gpt(batch, seq, vocab, d_model, n_head, n_layer)
