"""A zoo of small random Hugging Face models (no downloads), one factory per architecture.

Every factory returns ``(model, example_inputs)``: 2 layers, hidden 64, vocabulary
128, 4 heads, no dropout, batch 4. Token ids always contain the model's padding id
where it has one, so an embedding's ``padding_idx`` matters. Decoders run with
``use_cache=False`` (a cache is state torch.export cannot return). `ZOO` lists
them by family; `EXPECTED_ERRORS` names the models autoshard refuses with a
documented error, and which. `llama`, `gpt2`, `bert_mlm` and `t5` also take `seq`
(tokens per row, 8 by default) and `mask` (pass the padding's ``attention_mask``
too), for the memory tests, where what grows with the sequence (attention masks
and scores) must weigh.

Loaded by path in the rank processes (``tests/hf_zoo.py:bert``).
"""

from __future__ import annotations

import torch
import transformers as hf
from torch import nn

VOCAB, BATCH, SEQ = 128, 4, 8
PAD = 1  # the padding id every zoo config uses
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    max_position_embeddings=32,
)
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
DECODER = dict(SMALL, pad_token_id=PAD, bos_token_id=0, eos_token_id=2, use_cache=False)


class Run(nn.Module):
    """Calls the model with its inputs as keywords; returns the output fields `keep`."""

    def __init__(self, model: nn.Module, names: tuple[str, ...], keep: tuple[str, ...]):
        super().__init__()
        self.model, self.names, self.keep = model, names, keep

    def forward(self, *inputs):
        out = self.model(**dict(zip(self.names, inputs)))
        return tuple(out[k] for k in self.keep)


def ids(batch: int = BATCH, seq: int = SEQ, pad: int | None = PAD) -> torch.Tensor:
    """Random token ids whose last two positions of every other row are padding."""
    x = torch.randint(3, VOCAB, (batch, seq))
    if pad is not None:
        x[::2, -2:] = pad
    return x


def positions(seq: int) -> int:
    """The zoo's position table, long enough for `seq` tokens."""
    return max(32, seq)


def causal_lm(model_class, config, seq: int = SEQ, mask: bool = False) -> tuple[nn.Module, tuple]:
    model = model_class(config)  # first: a seed then gives what `init_weights` replays
    tokens = ids(seq=seq, pad=config.pad_token_id)
    return _run(model, ("input_ids", "labels"), ("loss",), (tokens, tokens.clone()), mask)


def encoder(model_class, config, keep=("last_hidden_state",)) -> tuple[nn.Module, tuple]:
    return Run(model_class(config), ("input_ids",), keep), (ids(pad=config.pad_token_id),)


def seq2seq(model_class, config, seq: int = SEQ, mask: bool = False) -> tuple[nn.Module, tuple]:
    names = ("input_ids", "decoder_input_ids", "labels")
    labels = ids(seq=seq, pad=None)
    model = model_class(config)
    inputs = (ids(seq=seq, pad=config.pad_token_id), ids(seq=seq), labels)
    return _run(model, names, ("loss",), inputs, mask)


def _run(model, names, keep, inputs, mask: bool) -> tuple[nn.Module, tuple]:
    """`Run(model, names, keep)` and `inputs`; with `mask`, the first input's padding
    mask (1 where a token is not padding, as a tokenizer's ``attention_mask``) is
    passed too, so that the model builds its attention mask from it."""
    if not mask:
        return Run(model, names, keep), inputs
    padding = (inputs[0] != model.config.pad_token_id).long()
    names = (names[0], "attention_mask", *names[1:])
    return Run(model, names, keep), (inputs[0], padding, *inputs[1:])


def images(size: int = 16, channels: int = 3) -> torch.Tensor:
    return torch.randn(BATCH, channels, size, size)


# -- encoder-only --------------------------------------------------------------------


def bert():
    return encoder(hf.BertModel, _bert_config(SEQ), ("last_hidden_state", "pooler_output"))


def bert_mlm(seq: int = SEQ, mask: bool = False):
    """BERT with its masked-LM head, its loss on the tokens themselves: one scalar, as
    a decoder's (an encoder's whole hidden states returned to every rank would
    outweigh the step's activations)."""
    return causal_lm(hf.BertForMaskedLM, _bert_config(seq), seq, mask)


def _bert_config(seq: int) -> hf.BertConfig:
    small = dict(SMALL, max_position_embeddings=positions(seq))
    return hf.BertConfig(**small, **NO_DROPOUT, pad_token_id=PAD)


def roberta():
    config = hf.RobertaConfig(**SMALL, **NO_DROPOUT, pad_token_id=PAD)
    return encoder(hf.RobertaModel, config)


def distilbert():
    config = hf.DistilBertConfig(
        vocab_size=VOCAB,
        dim=64,
        n_layers=2,
        n_heads=4,
        hidden_dim=128,
        max_position_embeddings=32,
        dropout=0.0,
        attention_dropout=0.0,
        pad_token_id=PAD,
    )
    return encoder(hf.DistilBertModel, config)


def albert():
    config = hf.AlbertConfig(**SMALL, **NO_DROPOUT, embedding_size=32, pad_token_id=PAD)
    return encoder(hf.AlbertModel, config)


def electra():
    config = hf.ElectraConfig(**SMALL, **NO_DROPOUT, embedding_size=32, pad_token_id=PAD)
    return encoder(hf.ElectraModel, config)


def deberta_v2():
    config = hf.DebertaV2Config(**SMALL, **NO_DROPOUT, pad_token_id=PAD)
    return encoder(hf.DebertaV2Model, config)


def modernbert():
    config = hf.ModernBertConfig(
        **SMALL,
        pad_token_id=PAD,
        attention_dropout=0.0,
        embedding_dropout=0.0,
        mlp_dropout=0.0,
        global_attn_every_n_layers=2,
        local_attention=4,
    )
    return encoder(hf.ModernBertModel, config)


def roformer():
    config = hf.RoFormerConfig(**SMALL, **NO_DROPOUT, pad_token_id=PAD)
    return encoder(hf.RoFormerModel, config)


def convbert():
    config = hf.ConvBertConfig(**SMALL, **NO_DROPOUT, embedding_size=64, pad_token_id=PAD)
    return encoder(hf.ConvBertModel, config)


def squeezebert():
    config = hf.SqueezeBertConfig(
        **SMALL,
        **NO_DROPOUT,
        embedding_size=64,
        pad_token_id=PAD,
        q_groups=2,
        k_groups=2,
        v_groups=2,
        post_attention_groups=2,
        intermediate_groups=4,
        output_groups=4,
    )
    return encoder(hf.SqueezeBertModel, config)


def luke():
    config = hf.LukeConfig(
        **SMALL, **NO_DROPOUT, entity_vocab_size=16, entity_emb_size=32, pad_token_id=PAD
    )
    return encoder(hf.LukeModel, config)


def megatron_bert():
    config = hf.MegatronBertConfig(**SMALL, **NO_DROPOUT, pad_token_id=PAD)
    return encoder(hf.MegatronBertModel, config)


def bigbird():
    config = hf.BigBirdConfig(
        **SMALL, **NO_DROPOUT, pad_token_id=PAD, attention_type="original_full"
    )
    return encoder(hf.BigBirdModel, config)


# -- decoder-only --------------------------------------------------------------------


def gpt2(seq: int = SEQ, mask: bool = False):
    config = hf.GPT2Config(
        vocab_size=VOCAB,
        n_positions=positions(seq),
        n_embd=64,
        n_layer=2,
        n_head=4,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=PAD,
        use_cache=False,
    )
    return causal_lm(hf.GPT2LMHeadModel, config, seq, mask)


def llama(seq: int = SEQ, mask: bool = False):
    decoder = dict(DECODER, max_position_embeddings=positions(seq))
    config = hf.LlamaConfig(**decoder, num_key_value_heads=2)
    return causal_lm(hf.LlamaForCausalLM, config, seq, mask)


def mistral():
    config = hf.MistralConfig(**DECODER, num_key_value_heads=2, sliding_window=4)
    return causal_lm(hf.MistralForCausalLM, config)


def qwen2():
    config = hf.Qwen2Config(**DECODER, num_key_value_heads=2)
    return causal_lm(hf.Qwen2ForCausalLM, config)


def qwen3():
    config = hf.Qwen3Config(**DECODER, num_key_value_heads=2, head_dim=16)
    return causal_lm(hf.Qwen3ForCausalLM, config)


def phi():
    config = hf.PhiConfig(**DECODER, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)
    return causal_lm(hf.PhiForCausalLM, config)


def phi3():
    config = hf.Phi3Config(**DECODER, num_key_value_heads=2, resid_pdrop=0.0, embd_pdrop=0.0)
    return causal_lm(hf.Phi3ForCausalLM, config)


def gemma():
    config = hf.GemmaConfig(**DECODER, num_key_value_heads=2, head_dim=16)
    return causal_lm(hf.GemmaForCausalLM, config)


def gemma2():
    config = hf.Gemma2Config(**DECODER, num_key_value_heads=2, head_dim=16, sliding_window=4)
    return causal_lm(hf.Gemma2ForCausalLM, config)


def opt():
    config = hf.OPTConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        ffn_dim=128,
        word_embed_proj_dim=64,
        max_position_embeddings=32,
        dropout=0.0,
        attention_dropout=0.0,
        pad_token_id=PAD,
        bos_token_id=0,
        eos_token_id=2,
        use_cache=False,
    )
    return causal_lm(hf.OPTForCausalLM, config)


def gpt_neox():
    config = hf.GPTNeoXConfig(**DECODER, hidden_dropout=0.0, attention_dropout=0.0, rotary_pct=0.5)
    return causal_lm(hf.GPTNeoXForCausalLM, config)


def gpt_neo():
    # makes its attention's mask value in forward, as a tensor of one number
    config = hf.GPTNeoConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        attention_types=[[["global", "local"], 1]],
        window_size=4,
        max_position_embeddings=32,
        embed_dropout=0.0,
        attention_dropout=0.0,
        resid_dropout=0.0,
        **{k: DECODER[k] for k in ("pad_token_id", "bos_token_id", "eos_token_id", "use_cache")},
    )
    return causal_lm(hf.GPTNeoForCausalLM, config)


def gptj():
    config = hf.GPTJConfig(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=64,
        n_layer=2,
        n_head=4,
        rotary_dim=8,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=PAD,
        use_cache=False,
    )
    return causal_lm(hf.GPTJForCausalLM, config)


def falcon():
    config = hf.FalconConfig(
        **DECODER, hidden_dropout=0.0, attention_dropout=0.0, new_decoder_architecture=False
    )
    return causal_lm(hf.FalconForCausalLM, config)


def bloom():
    config = hf.BloomConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        n_layer=2,
        n_head=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        pad_token_id=PAD,
        bos_token_id=0,
        eos_token_id=2,
        use_cache=False,
    )
    return causal_lm(hf.BloomForCausalLM, config)


def stablelm():
    config = hf.StableLmConfig(**DECODER, num_key_value_heads=2, hidden_dropout=0.0)
    return causal_lm(hf.StableLmForCausalLM, config)


def olmo():
    config = hf.OlmoConfig(**DECODER, num_key_value_heads=2)
    return causal_lm(hf.OlmoForCausalLM, config)


def starcoder2():
    config = hf.Starcoder2Config(
        **DECODER, num_key_value_heads=2, residual_dropout=0.0, embedding_dropout=0.0
    )
    return causal_lm(hf.Starcoder2ForCausalLM, config)


def rwkv():
    """Not in `ZOO`: in eval it rescales its weights in place, which autoshard refuses by
    name; trained, it equals serial (the solver's budget tests use it)."""
    config = hf.RwkvConfig(
        vocab_size=VOCAB,
        context_length=32,
        hidden_size=64,
        num_hidden_layers=2,
        attention_hidden_size=64,
        intermediate_size=128,
        use_cache=False,
        pad_token_id=PAD,
    )
    return causal_lm(hf.RwkvForCausalLM, config)


def biogpt():
    config = hf.BioGptConfig(**DECODER, **NO_DROPOUT, layerdrop=0.0)
    return causal_lm(hf.BioGptForCausalLM, config)


def granite():
    config = hf.GraniteConfig(
        **DECODER,
        num_key_value_heads=2,
        attention_dropout=0.0,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        logits_scaling=4.0,
        attention_multiplier=0.2,
    )
    return causal_lm(hf.GraniteForCausalLM, config)


def smollm3():
    config = hf.SmolLM3Config(
        **DECODER, num_key_value_heads=2, attention_dropout=0.0, no_rope_layer_interval=2
    )
    return causal_lm(hf.SmolLM3ForCausalLM, config)


def glm4():
    config = hf.Glm4Config(**DECODER, num_key_value_heads=2, head_dim=16, attention_dropout=0.0)
    return causal_lm(hf.Glm4ForCausalLM, config)


def helium():
    config = hf.HeliumConfig(**DECODER, num_key_value_heads=2, head_dim=16, attention_dropout=0.0)
    return causal_lm(hf.HeliumForCausalLM, config)


def ernie4_5():
    config = hf.Ernie4_5Config(**DECODER, num_key_value_heads=2, head_dim=16)
    return causal_lm(hf.Ernie4_5ForCausalLM, config)


# -- encoder-decoder -----------------------------------------------------------------

SEQ2SEQ = dict(
    vocab_size=VOCAB,
    d_model=64,
    encoder_layers=1,
    decoder_layers=1,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=128,
    decoder_ffn_dim=128,
    max_position_embeddings=32,
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
    pad_token_id=PAD,
    bos_token_id=0,
    eos_token_id=2,
    decoder_start_token_id=0,
    use_cache=False,
)


def t5(seq: int = SEQ, mask: bool = False):
    config = hf.T5Config(
        vocab_size=VOCAB,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=4,
        dropout_rate=0.0,
        pad_token_id=PAD,
        decoder_start_token_id=PAD,
        use_cache=False,
    )
    return seq2seq(hf.T5ForConditionalGeneration, config, seq, mask)


def bart():
    return seq2seq(hf.BartForConditionalGeneration, hf.BartConfig(**SEQ2SEQ))


def pegasus():
    return seq2seq(hf.PegasusForConditionalGeneration, hf.PegasusConfig(**SEQ2SEQ))


def marian():
    config = hf.MarianConfig(**SEQ2SEQ, decoder_vocab_size=VOCAB)
    return seq2seq(hf.MarianMTModel, config)


# -- vision --------------------------------------------------------------------------

VISION = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    image_size=16,
    patch_size=4,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)


def vision(model_class, config, keep=("last_hidden_state",), size=16):
    return Run(model_class(config), ("pixel_values",), keep), (images(size),)


def vit():
    return vision(hf.ViTModel, hf.ViTConfig(**VISION), ("last_hidden_state", "pooler_output"))


def deit():
    return vision(hf.DeiTModel, hf.DeiTConfig(**VISION))


def dinov2():
    config = hf.Dinov2Config(**{k: v for k, v in VISION.items() if k != "intermediate_size"})
    return vision(hf.Dinov2Model, config)


def swin():
    config = hf.SwinConfig(
        image_size=16,
        patch_size=2,
        embed_dim=32,
        depths=[1, 1],
        num_heads=[2, 4],
        window_size=4,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0,
    )
    return vision(hf.SwinModel, config)


def convnext():
    config = hf.ConvNextConfig(
        num_channels=3, patch_size=4, num_stages=2, hidden_sizes=[32, 64], depths=[1, 1]
    )
    return vision(hf.ConvNextModel, config, ("last_hidden_state", "pooler_output"))


def resnet():
    config = hf.ResNetConfig(embedding_size=16, hidden_sizes=[32, 64], depths=[1, 1])
    return vision(hf.ResNetModel, config)


def efficientnet():
    """Its convolutions pad by name ("same", "valid"), its images 32 pixels: seven
    stages of strides halve them down to 1."""
    config = hf.EfficientNetConfig(
        image_size=32,
        width_coefficient=0.1,
        depth_coefficient=0.25,
        hidden_dim=128,
        dropout_rate=0.0,
        drop_connect_rate=0.0,
    )
    return vision(hf.EfficientNetModel, config, ("last_hidden_state", "pooler_output"), size=32)


def poolformer():
    config = hf.PoolFormerConfig(
        image_size=16,
        depths=[1, 1],
        hidden_sizes=[32, 64],
        patch_sizes=[4, 2],
        strides=[4, 2],
        padding=[1, 0],
        num_encoder_blocks=2,
        drop_path_rate=0.0,
        hidden_dropout_prob=0.0,
    )
    return vision(hf.PoolFormerModel, config)


def regnet():
    config = hf.RegNetConfig(
        embedding_size=16, hidden_sizes=[32, 64], depths=[1, 1], groups_width=16
    )
    return vision(hf.RegNetModel, config, ("last_hidden_state", "pooler_output"))


# -- audio ---------------------------------------------------------------------------


def whisper():
    config = hf.WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=16,
        d_model=64,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_source_positions=8,
        max_target_positions=32,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=PAD,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=0,
        use_cache=False,
    )
    names = ("input_features", "decoder_input_ids", "labels")
    features = torch.randn(BATCH, 16, 16)  # mel bins × frames (2 × max_source_positions)
    model = Run(hf.WhisperForConditionalGeneration(config), names, ("loss",))
    return model, (features, ids(), ids(pad=None))


def wav2vec2():
    config = hf.Wav2Vec2Config(
        **SMALL,
        **NO_DROPOUT,
        conv_dim=(16, 16),
        conv_kernel=(4, 2),
        conv_stride=(4, 2),
        num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=4,
        feat_proj_dropout=0.0,
        activation_dropout=0.0,
        final_dropout=0.0,
        layerdrop=0.0,
        mask_time_prob=0.0,
    )
    return Run(hf.Wav2Vec2Model(config), ("input_values",), ("last_hidden_state",)), (
        torch.randn(BATCH, 64),
    )


# -- state-space ---------------------------------------------------------------------


def mamba():
    config = hf.MambaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        state_size=8,
        num_hidden_layers=2,
        expand=2,
        conv_kernel=4,
        pad_token_id=PAD,
        bos_token_id=0,
        eos_token_id=2,
        use_cache=False,
        use_mambapy=False,
    )
    return causal_lm(hf.MambaForCausalLM, config)


# -- mixture of experts --------------------------------------------------------------

MOE = dict(DECODER, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)


def mixtral():
    return causal_lm(hf.MixtralForCausalLM, hf.MixtralConfig(**MOE))


def qwen2_moe():
    config = hf.Qwen2MoeConfig(
        **DECODER,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
    )
    return causal_lm(hf.Qwen2MoeForCausalLM, config)


def olmoe():
    config = hf.OlmoeConfig(**DECODER, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2)
    return causal_lm(hf.OlmoeForCausalLM, config)


ZOO = {
    "encoder": ["bert", "roberta", "distilbert", "albert", "electra", "deberta_v2", "modernbert",
                "roformer", "convbert", "squeezebert", "luke", "megatron_bert", "bigbird"],
    "decoder": ["gpt2", "llama", "mistral", "qwen2", "qwen3", "phi", "phi3", "gemma", "gemma2",
                "opt", "gpt_neox", "gpt_neo", "gptj", "falcon", "bloom", "stablelm", "olmo",
                "starcoder2", "biogpt", "granite", "smollm3", "glm4", "helium", "ernie4_5"],
    "encoder-decoder": ["t5", "bart", "pegasus", "marian"],
    "vision": ["vit", "deit", "dinov2", "swin", "convnext", "resnet", "efficientnet", "poolformer",
               "regnet"],
    "audio": ["whisper", "wav2vec2"],
    "state-space": ["mamba"],
    "mixture-of-experts": ["mixtral", "qwen2_moe", "olmoe"],
}  # fmt: skip
MODELS = [name for family in ZOO.values() for name in family]

# Models autoshard refuses, with the documented error it raises and why.
EXPECTED_ERRORS: dict[str, tuple[str, str]] = {}
# Models `assert_equivalent` cannot check, and why (the parallel program is not at fault).
UNCHECKABLE: dict[str, str] = {}


def __getattr__(name: str):
    """``<model>_bf16``: the zoo model and its floating-point inputs in bfloat16."""
    base = globals().get(name.removesuffix("_bf16"))
    if not name.endswith("_bf16") or base is None:
        raise AttributeError(f"the zoo has no model {name!r}")

    def bf16():
        model, inputs = base()
        cast = tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in inputs)
        return model.to(torch.bfloat16), cast

    return bf16
