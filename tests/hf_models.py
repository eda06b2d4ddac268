"""Small random Hugging Face models (no downloads) wrapped to take positional tensors
and return what the tests compare. Loaded by path in the rank processes."""

import torch
from torch import nn
from transformers import (
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    OPTConfig,
    OPTForCausalLM,
)

VOCAB, BATCH, SEQ = 64, 4, 8


class CausalLM(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        return self.model(input_ids=ids, labels=labels, use_cache=False).loss


class Encoder(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        out = self.model(input_ids=ids)
        return out.last_hidden_state, out.pooler_output


def _tokens(n=2, pad=None):
    """`n` id tensors; with `pad`, the last two positions of every other row are padding,
    so the padding row of the embedding is looked up (and must get no gradient)."""
    ids = tuple(torch.randint(0, VOCAB, (BATCH, SEQ)) for _ in range(n))
    if pad is not None:
        ids[0][::2, -2:] = pad
    return ids


def gpt2():
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=32,
        n_layer=2,
        n_head=4,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return CausalLM(GPT2LMHeadModel(config)), _tokens()


def llama():
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        bos_token_id=0,
        eos_token_id=0,
    )
    return CausalLM(LlamaForCausalLM(config)), _tokens()


def bert():
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return Encoder(BertModel(config)), _tokens(1, pad=config.pad_token_id)


def opt():
    config = OPTConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        ffn_dim=64,
        num_attention_heads=4,
        max_position_embeddings=SEQ,
        word_embed_proj_dim=32,
        dropout=0.0,
        attention_dropout=0.0,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=0,
    )
    return CausalLM(OPTForCausalLM(config)), _tokens(pad=config.pad_token_id)
