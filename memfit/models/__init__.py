"""Model presets for the demo, benchmarks and the CLI: HF transformers, randomly initialised.

Nothing is downloaded: every model is built from a config and initialised with a seed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Shape:
    """A transformer's sizes (BERT, GPT-2 and Llama read the same fields). The default is sized
    for a 2-core CPU."""

    layers: int = 4
    hidden: int = 256
    heads: int = 4
    seq: int = 128
    batch: int = 8
    vocab: int = 8192
    dropout: float = 0.1
    intermediate: int = 0  # the MLP's width; 0: 4 x hidden (BERT, GPT-2), about 8/3 x hidden (Llama)
    kv_heads: int = 0  # Llama's key/value heads; 0: heads / 2

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if min(self.layers, self.hidden, self.heads, self.seq, self.batch, self.vocab) < 1:
            raise ValueError(f"every size must be >= 1: {self}")


def bert_mlm(shape: Shape, seed: int = 0) -> nn.Module:
    """A randomly initialised ``transformers.BertForMaskedLM`` of ``shape``."""
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        intermediate_size=shape.intermediate or 4 * shape.hidden,
        max_position_embeddings=max(512, shape.seq),
        hidden_dropout_prob=shape.dropout,
        attention_probs_dropout_prob=shape.dropout,
    )
    torch.manual_seed(seed)
    return BertForMaskedLM(cfg)


def bert_layer_class() -> type[nn.Module]:
    from transformers.models.bert.modeling_bert import BertLayer

    return BertLayer


def mlm_batch(shape: Shape, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random token ids and MLM labels (15% of positions predicted, the rest ignored)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=g)
    labels = ids.clone()
    labels[torch.rand(ids.shape, generator=g) > 0.15] = -100
    return {"input_ids": ids, "labels": labels}


def gpt2_lm(shape: Shape, seed: int = 0) -> nn.Module:
    """A randomly initialised ``transformers.GPT2LMHeadModel`` of ``shape``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=shape.vocab,
        n_embd=shape.hidden,
        n_layer=shape.layers,
        n_head=shape.heads,
        n_positions=max(1024, shape.seq),
        n_inner=shape.intermediate or None,
        resid_pdrop=shape.dropout,
        embd_pdrop=shape.dropout,
        attn_pdrop=shape.dropout,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,  # training: no key/value cache
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg)


def lm_batch(shape: Shape, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random token ids; the labels are the ids (the model shifts them for next-token loss)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _llama_intermediate(hidden: int) -> int:
    return int(hidden * 8 / 3) // 64 * 64 or 64


def llama_lm(shape: Shape, seed: int = 0) -> nn.Module:
    """A randomly initialised ``transformers.LlamaForCausalLM`` of ``shape`` (grouped KV heads: heads/2)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate or _llama_intermediate(shape.hidden),
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads or max(1, shape.heads // 2),
        max_position_embeddings=max(2048, shape.seq),
        attention_dropout=shape.dropout,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


@dataclass(frozen=True)
class Preset:
    """A named architecture and shape for the CLI and benchmarks."""

    arch: str  # "bert" (masked LM), "gpt2" or "llama" (causal LM)
    shape: Shape

    def build(self, seed: int = 0) -> nn.Module:
        return {"bert": bert_mlm, "gpt2": gpt2_lm, "llama": llama_lm}[self.arch](self.shape, seed)

    def resolved(self) -> Shape:
        """The shape as built: the MLP width and key/value heads that 0 stands for filled in."""
        s = self.shape
        if self.arch == "llama":
            intermediate = s.intermediate or _llama_intermediate(s.hidden)
            return dataclasses.replace(s, intermediate=intermediate, kv_heads=s.kv_heads or max(1, s.heads // 2))
        return dataclasses.replace(s, intermediate=s.intermediate or 4 * s.hidden, kv_heads=s.kv_heads or s.heads)

    def resized(self, **sizes: int | None) -> Preset:
        """This preset with some sizes (layers, hidden, seq, batch, ...) replaced; None keeps one."""
        given = {k: v for k, v in sizes.items() if v}
        return Preset(self.arch, dataclasses.replace(self.shape, **given))

    def layer_class(self) -> type[nn.Module]:
        if self.arch == "bert":
            return bert_layer_class()
        if self.arch == "gpt2":
            from transformers.models.gpt2.modeling_gpt2 import GPT2Block

            return GPT2Block
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        return LlamaDecoderLayer


# Sized for a 2-core CPU by default; the real sizes for `--model bert-large` and friends.
PRESETS = {
    "bert": Preset("bert", Shape(layers=4, hidden=256, heads=4, seq=128, batch=8, vocab=30522)),
    "gpt2": Preset("gpt2", Shape(layers=4, hidden=256, heads=4, seq=128, batch=8, vocab=50257)),
    "llama": Preset("llama", Shape(layers=4, hidden=256, heads=4, seq=128, batch=8, vocab=32000, dropout=0.0)),
    "bert-base": Preset("bert", Shape(layers=12, hidden=768, heads=12, seq=512, batch=8, vocab=30522)),
    "bert-large": Preset("bert", Shape(layers=24, hidden=1024, heads=16, seq=512, batch=8, vocab=30522)),
    "gpt2-small": Preset("gpt2", Shape(layers=12, hidden=768, heads=12, seq=1024, batch=4, vocab=50257)),
    "gpt2-medium": Preset("gpt2", Shape(layers=24, hidden=1024, heads=16, seq=1024, batch=4, vocab=50257)),
    "llama-1b": Preset("llama", Shape(layers=16, hidden=2048, heads=32, seq=2048, batch=1, vocab=32000, dropout=0.0)),
    "gpt2-xl": Preset("gpt2", Shape(layers=48, hidden=1600, heads=25, seq=1024, batch=4, vocab=50257)),
    # Llama 3 8B and 70B (Meta's published configs: grouped KV heads, 128k vocabulary), 8k context.
    "llama-8b": Preset(
        "llama",
        Shape(
            layers=32,
            hidden=4096,
            heads=32,
            kv_heads=8,
            intermediate=14336,
            seq=8192,
            batch=1,
            vocab=128256,
            dropout=0.0,
        ),
    ),
    "llama-70b": Preset(
        "llama",
        Shape(
            layers=80,
            hidden=8192,
            heads=64,
            kv_heads=8,
            intermediate=28672,
            seq=8192,
            batch=1,
            vocab=128256,
            dropout=0.0,
        ),
    ),
}
