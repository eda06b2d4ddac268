"""Model factories for the view, input-gradient and mode tests: each returns
(model, example_inputs). Rank processes load them by path, so they are
module-level functions with no arguments."""

import torch
from torch import nn

B, S, E, HEADS = 4, 8, 16, 4


def _tokens(batch_first: bool, requires_grad: bool = False) -> torch.Tensor:
    x = torch.randn((B, S, E) if batch_first else (S, B, E))
    return x.requires_grad_(requires_grad)


def _encoder(batch_first: bool) -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(E, HEADS, 2 * E, dropout=0.0, batch_first=batch_first)
    return nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)


class SelfAttention(nn.Module):
    """nn.MultiheadAttention on (x, x, x), returning the output and averaged weights."""

    def __init__(self, batch_first: bool, dropout: float = 0.0):
        super().__init__()
        self.attention = nn.MultiheadAttention(E, HEADS, dropout=dropout, batch_first=batch_first)

    def forward(self, x):
        return self.attention(x, x, x)


class AttentionStack(nn.Module):
    """torch's own attention modules as a user stacks them: a batch-first
    TransformerEncoder, a sequence-first one, then batch-first and sequence-first
    nn.MultiheadAttention (both outputs and weights returned)."""

    def __init__(self):
        super().__init__()
        self.batch_first = _encoder(True)
        self.sequence_first = _encoder(False)
        self.attention = SelfAttention(True)
        self.attention_sequence_first = SelfAttention(False)

    def forward(self, x):
        h = self.batch_first(x)
        h = self.sequence_first(h.transpose(0, 1)).transpose(0, 1)
        out, weights = self.attention(h)
        last, last_weights = self.attention_sequence_first(out.transpose(0, 1))
        return last, weights, last_weights


def attention_stack():
    return AttentionStack(), (_tokens(True),)


class TransposedLinear(nn.Module):
    """The minimal form of the attention bug: x.transpose(0, 1).reshape(T * B, E) →
    Linear → view → transpose."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(E, E)

    def forward(self, x):
        t = x.transpose(0, 1)
        return self.proj(t.reshape(S * B, E)).view(S, B, E).transpose(0, 1)


def transposed_linear():
    return TransposedLinear(), (_tokens(True),)


def transposed_linear_input_grad():
    return TransposedLinear(), (_tokens(True, requires_grad=True),)


class TwoInputs(nn.Module):
    """Two inputs that require grad, one read by a linear and one added after it,
    and an integer input that cannot."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(E, 2 * E)
        self.fc2 = nn.Linear(2 * E, E)

    def forward(self, x, skip, positions):
        return self.fc2(torch.relu(self.fc1(x))) + skip * positions.unsqueeze(-1)


def two_inputs_with_grad():
    x, skip = _tokens(True, requires_grad=True), _tokens(True, requires_grad=True)
    return TwoInputs(), (x, skip, torch.arange(S).repeat(B, 1))


def attention_input_grad():
    return SelfAttention(True), (_tokens(True, requires_grad=True),)


class DropoutMLP(nn.Module):
    def __init__(self, p: float = 0.25):
        super().__init__()
        self.fc1 = nn.Linear(E, 2 * E)
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(2 * E, E)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def dropout_mlp_train():
    return DropoutMLP().train(), (_tokens(True),)


def dropout_mlp_eval():
    return DropoutMLP().eval(), (_tokens(True),)


class TransposedDropout(DropoutMLP):
    """Dropout on a transposed activation: torch draws its mask in the memory order of
    the input's strides, not in the order of its indices."""

    def forward(self, x):
        h = torch.relu(self.fc1(x)).transpose(0, 1)
        return self.fc2(self.drop(h))


def dropout_transposed_train():
    return TransposedDropout().train(), (_tokens(True),)


def dropout_attention_train():
    return SelfAttention(True, dropout=0.25).train(), (_tokens(True),)


def dropout_attention_eval():
    return SelfAttention(True, dropout=0.25).eval(), (_tokens(True),)


class NormalizedMLP(nn.Module):
    """A batch norm: its train and eval graphs differ beyond dropout."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(E, E)
        self.norm = nn.BatchNorm1d(E)

    def forward(self, x):
        return self.norm(self.fc(x))


def batch_norm_mlp():
    return NormalizedMLP(), (torch.randn(B * S, E),)


class Seq2Seq(nn.Module):
    """nn.Transformer as its tutorial uses it: a causal target mask made in forward
    and given with no ``tgt_is_causal`` hint, and padding masks over source and
    target (batch-first); then a sequence-first nn.TransformerEncoder given a causal
    ``mask`` with no ``is_causal`` hint. Both would compare their mask's values with a
    causal mask to choose a kernel, which torch.export cannot trace."""

    def __init__(self):
        super().__init__()
        self.transformer = nn.Transformer(
            E, HEADS, 1, 1, 2 * E, dropout=0.0, batch_first=True, norm_first=True
        )
        self.sequence_first = _encoder(False)

    def forward(self, src, tgt, src_padding, tgt_padding):
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        h = self.transformer(
            src,
            tgt,
            tgt_mask=causal,
            src_key_padding_mask=src_padding,
            tgt_key_padding_mask=tgt_padding,
            memory_key_padding_mask=src_padding,
        )
        return self.sequence_first(h.transpose(0, 1), mask=causal).transpose(0, 1)


def _padding(*padded: tuple[int, int]) -> torch.Tensor:
    """A key padding mask over (B, S): True at the last `n` positions of sequence b."""
    mask = torch.zeros(B, S, dtype=torch.bool)
    for b, n in padded:
        mask[b, S - n :] = True
    return mask


def seq2seq():
    return Seq2Seq(), (_tokens(True), _tokens(True), _padding((0, 2), (3, 5)), _padding((1, 3)))


def seq2seq_eval():
    model, inputs = seq2seq()
    return model.eval(), inputs


class FusedProjections(nn.Module):
    """One projection for q, k and v, split into them (GPT-2, MPT), and one for a gated
    MLP's two halves, chunked (GLU): pieces of a dim the projection splits. `cut`
    "sliced" cuts the same pieces as slices, as Phi-3 does (``qkv[..., :E]``,
    ``qkv[..., E:2 * E]``, …); "multi_query" projects one key and one value head
    besides the query heads and splits the heads, as Falcon does: the key and value
    pieces divide over no axis."""

    def __init__(self, cut: str = "split"):
        super().__init__()
        self.cut = cut
        kv = 2 * E // HEADS if cut == "multi_query" else 2 * E
        self.qkv = nn.Linear(E, E + kv)
        self.out = nn.Linear(E, E)
        self.up = nn.Linear(E, 4 * E)
        self.down = nn.Linear(2 * E, E)

    def pieces(self, t: torch.Tensor, count: int) -> list[torch.Tensor]:
        size = t.shape[-1] // count
        if self.cut == "sliced":
            return [t[..., i * size : (i + 1) * size] for i in range(count)]
        return list(t.split(size, dim=-1) if count == 3 else t.chunk(count, dim=-1))

    def forward(self, x):
        if self.cut == "multi_query":
            heads = self.qkv(x).view(B, S, HEADS + 2, E // HEADS)
            q, k, v = (t.transpose(1, 2) for t in heads.split([HEADS, 1, 1], dim=2))
        else:
            heads = (B, S, HEADS, E // HEADS)
            q, k, v = (t.view(heads).transpose(1, 2) for t in self.pieces(self.qkv(x), 3))
        attend = nn.functional.scaled_dot_product_attention
        attended = attend(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.out(attended.transpose(1, 2).reshape(B, S, E))
        gate, value = self.pieces(self.up(x), 2)
        return x + self.down(nn.functional.silu(gate) * value)


def fused_projections():
    return FusedProjections(), (_tokens(True, requires_grad=True),)


def sliced_projections():
    return FusedProjections("sliced"), (_tokens(True, requires_grad=True),)


def multi_query_projection():
    return FusedProjections("multi_query"), (_tokens(True, requires_grad=True),)


class FewSequences(nn.Module):
    """Two sequences on 2×2×2: the batch takes one axis, the four query heads another,
    and the third comes to attention splitting the sequence. Attention three ways:
    causal (`is_causal`) and under a mask built as Hugging Face builds it (causal and
    key padding, [B, 1, S, S]), both grouped-query (one key/value head, `enable_gqa`),
    and with four key/value heads under a key padding mask ([B, 1, 1, S])."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(E, E)
        self.grouped = nn.Linear(E, 2 * E // HEADS)
        self.kv = nn.Linear(E, 2 * E)
        self.out = nn.Linear(E, E)

    def forward(self, x, keep):
        b, s, e = x.shape

        def heads(t):
            return t.view(b, s, -1, e // HEADS).transpose(1, 2)

        q = heads(self.q(x))
        k1, v1 = (heads(t) for t in self.grouped(x).chunk(2, dim=-1))
        k, v = (heads(t) for t in self.kv(x).chunk(2, dim=-1))
        attend = nn.functional.scaled_dot_product_attention
        causal = attend(q, k1, v1, is_causal=True, enable_gqa=True)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()[None, None]
        padded = attend(q, k1, v1, attn_mask=mask & keep[:, None, None, :], enable_gqa=True)
        full = attend(q, k, v, attn_mask=keep[:, None, None, :])
        return x + self.out((causal + padded + full).transpose(1, 2).reshape(b, s, e))


def few_sequences():
    keep = torch.ones(2, S, dtype=torch.bool)
    keep[1, -3:] = False  # the second sequence padded
    return FewSequences(), (torch.randn(2, S, E, requires_grad=True), keep)


def few_sequences_eval():
    model, inputs = few_sequences()
    return model.eval(), inputs


class MeanSquare(nn.Module):
    """`model`'s output reduced to a loss, so that a step is a backward of one number."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *inputs):
        return self.model(*inputs).square().mean()


def few_sequences_loss():
    model, inputs = few_sequences()
    return MeanSquare(model), inputs


class StackedTargets(nn.Module):
    """Targets for two predictions per token (ProphetNet's n-gram loss): the labels
    stacked to [B, 2, S], no gradient, flattened to the loss's rows, which are split."""

    def __init__(self, dim: int = 16, vocab: int = 12):
        super().__init__()
        self.vocab = vocab
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x, labels):
        logits = self.head(torch.stack([x, self.mix(x)], dim=1))  # [B, 2, S, V]
        targets = torch.stack([labels, labels], dim=1)
        scores = nn.functional.log_softmax(logits.view(-1, self.vocab), dim=-1)
        return nn.functional.nll_loss(scores, targets.view(-1), ignore_index=0)


def stacked_targets():
    torch.manual_seed(0)
    return StackedTargets(), (torch.randn(4, 8, 16), torch.randint(0, 12, (4, 8)))
