"""A Hugging Face model built on the meta device, parallelized, and filled from a
``save_pretrained`` directory slice by slice equals the serial model; `save_hf`
writes back what ``from_pretrained`` reads."""

import pytest
import torch
from hf_zoo import llama
from transformers import LlamaForCausalLM

import autoshard


def _serial():
    torch.manual_seed(0)
    return llama()


def _meta_loaded(mesh, directory, inputs, out_dir):
    """Loss, gradients and the parameters' devices of a meta-built model after load_hf."""
    with torch.device("meta"):
        model, _ = llama()
    parallel = autoshard.parallelize(model, mesh, inputs, strategy="3d")
    autoshard.checkpoint.load_hf(parallel, directory, prefix="model.")
    (loss,) = parallel(*inputs)
    loss.backward()
    grads = parallel.full_grads()
    autoshard.checkpoint.save_hf(parallel, out_dir, prefix="model.", max_shard_bytes=40_000)
    devices = {p.device.type for p in parallel.parameters()}
    return loss.item(), grads, devices


@pytest.mark.parametrize("shard_size", [None, "20KB"], ids=["one file", "sharded"])
def test_meta_model_loaded_from_hf_equals_serial(rank_pool, tmp_path, shard_size):
    serial, inputs = _serial()
    directory = tmp_path / "hf"
    options = {"max_shard_size": shard_size} if shard_size else {}
    serial.model.save_pretrained(directory, **options)
    (want,) = serial(*inputs)
    want.backward()
    out_dir = tmp_path / "back"
    results = rank_pool.run(_meta_loaded, (2, 2, 2), str(directory), inputs, str(out_dir))
    for rank, (loss, grads, devices) in enumerate(results):
        assert devices == {"cpu"}, rank
        assert abs(loss - want.item()) <= 1e-5 * abs(want.item()), (rank, loss, want.item())
        for name, param in serial.named_parameters():
            err = (grads[name] - param.grad).abs().max().item()
            assert err <= 1e-5 * param.grad.abs().max().item(), (rank, name, err)
    # what save_hf wrote loads with from_pretrained and gives the same loss
    reloaded = LlamaForCausalLM.from_pretrained(out_dir)
    again = reloaded(input_ids=inputs[0], labels=inputs[1], use_cache=False).loss
    assert abs(again.item() - want.item()) <= 1e-6 * abs(want.item())
    assert len(list(out_dir.glob("model-*.safetensors"))) > 1  # written in shards


def test_hf_weights_that_do_not_fit_are_refused(tmp_path):
    serial, _ = _serial()
    with pytest.raises(autoshard.CheckpointError, match="no Hugging Face weights at"):
        autoshard.checkpoint.load_hf(serial, tmp_path / "nowhere", prefix="model.")
    serial.model.save_pretrained(tmp_path / "hf")
    with pytest.raises(autoshard.CheckpointError, match="is prefix='' right"):
        autoshard.checkpoint.load_hf(serial, tmp_path / "hf")
    other, _ = _serial()
    other.model.lm_head = torch.nn.Linear(64, 70, bias=False)  # another vocabulary
    with pytest.raises(autoshard.CheckpointError, match=r"has shape \[128, 64\] .* but \[70, 64\]"):
        autoshard.checkpoint.load_hf(other, tmp_path / "hf", prefix="model.")
