"""Transformer models, unmodified, match the serial model under the 3D families."""

from pathlib import Path

import pytest

from autoshard.testing import assert_equivalent

ROOT = Path(__file__).parents[1]
GPT, LLAMA = ROOT / "examples/gpt.py", ROOT / "examples/llama.py"
HF = Path(__file__).parent / "hf_zoo.py"
MESHES = [(2, 2, 2), (1, 2, 4)]
MIXED = {"*.0.*": "replicated", "*.1.*": "3d-allreduce", "*": "3d"}
STRATEGIES = ["3d", "3d-allreduce", MIXED]
# `make test` runs each strategy on one mesh; `make zoo` runs the whole matrix.
QUICK = {("3d", (2, 2, 2)), ("3d-allreduce", (1, 2, 4)), (str(MIXED), (2, 2, 2))}


def _matrix(quick) -> list:
    return [
        pytest.param(s, m, marks=() if (str(s), m) in quick else pytest.mark.zoo)
        for s in STRATEGIES
        for m in MESHES
    ]


MATRIX = _matrix(QUICK)
HF_MATRIX = _matrix(QUICK - {("3d", (2, 2, 2))})  # the zoo runs them under "3d" on 2×2×2


@pytest.mark.parametrize("strategy,mesh", MATRIX, ids=str)
@pytest.mark.parametrize("factory", [f"{GPT}:gpt", f"{LLAMA}:llama"], ids=["gpt", "llama"])
def test_examples(factory, mesh, strategy):
    assert_equivalent(factory, mesh, strategy=strategy)


@pytest.mark.parametrize(
    "factory", [f"{GPT}:gpt_explicit", f"{LLAMA}:llama_mqa"], ids=["explicit-attention", "mqa"]
)
def test_attention_variants(factory):
    assert_equivalent(factory, (2, 2, 2), strategy="3d")


@pytest.mark.parametrize("strategy,mesh", HF_MATRIX, ids=str)
@pytest.mark.parametrize("model", ["gpt2", "llama", "bert"])
def test_hugging_face(model, mesh, strategy):
    pytest.importorskip("transformers")
    assert_equivalent(f"{HF}:{model}", mesh, strategy=strategy)


@pytest.mark.parametrize("strategy", ["3d", "3d-allreduce"])
def test_hugging_face_padding(strategy):
    pytest.importorskip("transformers")  # OPT's inputs hit its padding id (BERT's too)
    assert_equivalent(f"{HF}:opt", (2, 2, 2), strategy=strategy)
