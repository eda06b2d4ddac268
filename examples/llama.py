"""A LLaMA language model (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU).

autoshard show examples/llama.py:llama --mesh 2x2x2
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LlamaConfig:
    vocab: int = 64
    d_model: int = 32
    n_head: int = 4
    n_kv_head: int = 2
    n_layer: int = 2
    hidden: int = 64
    rope_theta: float = 10000.0
    eps: float = 1e-6


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.type_as(x) * self.weight


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        exponents = torch.arange(0, self.head_dim, 2).float() / self.head_dim
        return 1.0 / self.theta**exponents

    def reset_parameters(self) -> None:
        """Recompute the frequencies (what a model built on meta lacks)."""
        with torch.no_grad():
            self.inv_freq.copy_(self._inv_freq())

    def forward(self, x, T: int):
        pos = torch.arange(T, device=x.device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x, cos, sin):
    return x * cos + rotate_half(x) * sin


def repeat_kv(x, n_rep: int):
    """[B, n_kv_head, T, D] -> [B, n_kv_head * n_rep, T, D], as in HF transformers."""
    B, H, T, D = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(B, H, n_rep, T, D).reshape(B, H * n_rep, T, D)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        assert cfg.d_model % cfg.n_head == 0 and cfg.n_head % cfg.n_kv_head == 0
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.d_model // cfg.n_head
        kv_dim = cfg.n_kv_head * self.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, kv_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, kv_dim, bias=False)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        n_rep = self.n_head // self.n_kv_head
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.hidden, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.hidden, bias=False)
        self.down_proj = nn.Linear(cfg.hidden, cfg.d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_norm = RMSNorm(cfg.d_model, cfg.eps)
        self.attn = Attention(cfg)
        self.post_attn_norm = RMSNorm(cfg.d_model, cfg.eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.input_norm(x), cos, sin)
        return x + self.mlp(self.post_attn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.rotary = RotaryEmbedding(cfg.d_model // cfg.n_head, cfg.rope_theta)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, idx, targets):
        x = self.embed(idx)
        cos, sin = self.rotary(x, idx.shape[1])
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def llama(
    batch: int = 4,
    seq: int = 8,
    vocab: int = 64,
    d_model: int = 32,
    n_head: int = 4,
    n_kv_head: int = 2,
    n_layer: int = 2,
    hidden: int = 64,
):
    """A small LLaMA with grouped-query attention: (model, (idx, targets))."""
    cfg = LlamaConfig(vocab, d_model, n_head, n_kv_head, n_layer, hidden)
    idx = torch.randint(0, vocab, (batch, seq))
    targets = torch.randint(0, vocab, (batch, seq))
    return Llama(cfg), (idx, targets)


def llama_mqa(
    batch: int = 4,
    seq: int = 8,
    vocab: int = 64,
    d_model: int = 32,
    n_head: int = 4,
    n_layer: int = 2,
    hidden: int = 64,
):
    """`llama` with multi-query attention: a single key/value head shared by all heads."""
    return llama(batch, seq, vocab, d_model, n_head, 1, n_layer, hidden)
