"""Models the tests share, one definition each (a model used by one test file stays there)."""

import torch
from torch import nn


class MLP(nn.Module):
    """Uneven first dimensions (5, 13, 7, 3), so shards are uneven and some are empty at W=4."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 13)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(13, 7), nn.Tanh(), nn.Linear(7, 13)) for _ in range(3))
        self.out = nn.Linear(13, 3)
        self.scale = nn.Parameter(torch.tensor(1.5))  # 0-dim
        self.skip: set[int] = set()  # blocks to skip (to make ranks diverge on purpose)

    def forward(self, x):
        x = self.inp(x)
        for i, b in enumerate(self.blocks):
            if i not in self.skip:
                x = x + b(x)
        return self.out(x) * self.scale


class AttnBlock(nn.Module):
    """A pre-norm transformer block: causal self-attention, then a GELU feed-forward."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        # No qkv bias: the key bias has a zero gradient in exact arithmetic (softmax ignores a
        # shift shared by all keys), and AdamW turns its round-off into lr-sized steps.
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.heads = heads

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.ff(self.ln2(x))


class TinyLM(nn.Module):
    """A decoder with the input embedding tied to the LM head."""

    def __init__(self, vocab=37, d=16, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(AttnBlock(d) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def tiny_bert(vocab=120, layers=3, dropout=0.1, seed=0):
    """A randomly initialised HF ``BertForMaskedLM``: hidden 32, 4 heads, sequences up to 32."""
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    torch.manual_seed(seed)
    return BertForMaskedLM(cfg)


def make_model(kind, seed=0):
    """The sharding tests' models by name: "mlp" (MLP), "lm" (TinyLM), "bert" (2 layers, no dropout)."""
    torch.manual_seed(seed)
    if kind == "bert":
        return tiny_bert(vocab=97, layers=2, dropout=0.0, seed=seed)
    return {"mlp": MLP, "lm": TinyLM}[kind]()


def tanh_blocks(n, d, h):
    """``n`` blocks of depth ``d``: (Linear h -> h without bias, then Tanh) ``d`` times each."""
    return [nn.Sequential(*[m for _ in range(d) for m in (nn.Linear(h, h, bias=False), nn.Tanh())]) for _ in range(n)]


def tiny_gpt2(vocab=97, layers=2, seed=0):
    """A randomly initialised HF ``GPT2LMHeadModel`` (LM head tied to the input embedding):
    hidden 32, 2 heads, sequences up to 32, no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=vocab,
        n_positions=32,
        n_embd=32,
        n_layer=layers,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg)
