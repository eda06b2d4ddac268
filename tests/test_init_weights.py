"""`ParallelModule.init_weights` fills a model built on meta with exactly the values
the serial model's own construction gives under the same seed, each rank holding
only its shards; what it cannot replay it refuses by name."""

import sys
from pathlib import Path

import torch
from torch import nn

import autoshard

EXAMPLES = Path(__file__).parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

from gpt import GPT, GPTConfig  # noqa: E402
from hf_zoo import Run  # noqa: E402
from llama import Llama, LlamaConfig  # noqa: E402
from transformers import LlamaConfig as HFLlamaConfig  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402


def _gpt():
    return GPT(GPTConfig(explicit_attention=True))  # its causal mask is a buffer


def _llama():
    return Llama(LlamaConfig())


def _hf_llama():
    config = HFLlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8,
        bos_token_id=0,
        eos_token_id=0,
    )
    return Run(LlamaForCausalLM(config), ("input_ids", "labels"), ("loss",))


class Bare(nn.Module):
    """A parameter drawn in __init__ with no reset_parameters(): not replayable."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(8))
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x * self.scale).sum()


class _Embeddings(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(64, 8)
        self.register_buffer("type_ids", torch.ones(8, dtype=torch.long))

    def forward(self, x):
        return self.table(x) + self.table(self.type_ids)


class TypeIds(nn.Module):
    """An integer buffer its `_init_weights` zeroes (BERT's token type ids): zero is what
    a replayed integer held before, and the buffer is written all the same."""

    def __init__(self):
        super().__init__()
        self.embeddings = _Embeddings()
        self.head = nn.Linear(8, 4)
        self.apply(self._init_weights)

    @torch.no_grad()
    def _init_weights(self, module):
        if isinstance(module, _Embeddings):
            module.type_ids.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, 0.02)

    def forward(self, x, y):
        return self.head(self.embeddings(x)).sum()


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, h):
        return self.fc(h)


class ChildWriter(nn.Module):
    """Its `_init_weights` of a block draws the block's linear's weight (T5's attention
    blocks, GPT-2's, Mamba's mixers): each module is replayed alone, so the replay
    cannot repeat it, and says so rather than keep the linear's own reset."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 8)
        self.block = _Block()
        self.apply(self._init_weights)

    @torch.no_grad()
    def _init_weights(self, module):
        if isinstance(module, _Block):
            module.fc.weight.normal_(0.0, 0.02)

    def forward(self, x, y):
        return self.block(self.emb(x)).sum()


def _inputs(name: str):
    ids = torch.randint(0, 64, (4, 8), device="meta")
    return (ids, ids) if name != "bare" else (torch.empty(4, 8, device="meta"),)


BUILDERS = {
    "gpt": _gpt,
    "llama": _llama,
    "hf-llama": _hf_llama,
    "type-ids": TypeIds,
    "bare": Bare,
    "child-writer": ChildWriter,
}


def _meta(name: str) -> torch.nn.Module:
    with torch.device("meta"):
        return BUILDERS[name]()


def _initialized(mesh, name: str, seed: int, compiled):
    """The full state after init_weights (rank 0 only), and this rank's shard sizes."""
    parallel = autoshard.parallelize(_meta(name), mesh, _inputs(name), compiled=compiled)
    try:
        parallel.init_weights(seed=seed)
    except autoshard.CheckpointError as error:
        return str(error)
    full = parallel._gathered(parallel.program.state_dict(keep_vars=True), rank0_only=True)
    return full, sum(t.numel() for t in parallel.parameters())


def _all(mesh, compiled: dict):
    return {name: _initialized(mesh, name, 5, compiled[name]) for name in BUILDERS}


def test_init_weights_equals_the_serial_construction(rank_pool):
    compiled = {  # once here, for every rank
        name: autoshard.compile(_meta(name), (2, 2, 2), _inputs(name), strategy="3d")
        for name in BUILDERS
    }
    per_rank = rank_pool.run(_all, (2, 2, 2), compiled)
    for name in ("gpt", "llama", "hf-llama", "type-ids"):
        torch.manual_seed(5)
        serial = BUILDERS[name]()
        want = {**dict(serial.named_parameters()), **dict(serial.named_buffers())}
        full, local = per_rank[0][name]
        assert set(want) <= set(full), (name, set(want) - set(full))
        for fqn, tensor in want.items():
            assert torch.equal(full[fqn], tensor), (name, fqn)
        total = sum(p.numel() for p in serial.parameters())
        assert all(r[name][1] < total for r in per_rank), name  # every rank holds shards only
    for rank, results in enumerate(per_rank):
        assert "'scale' of a Bare" in results["bare"], (rank, results["bare"])
        assert "give Bare a reset_parameters()" in results["bare"], rank
        refused = results["child-writer"]
        assert "ChildWriter._init_weights of _Block 'block'" in refused, (rank, refused)
        assert "writes tensors of the module's submodules" in refused, (rank, refused)
