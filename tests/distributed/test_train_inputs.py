"""memfit train on the user's model and data: a local HF config.json with text tokenized by a
local tokenizer.json, a factory with nanoGPT's .bin token array; what it logs as it goes."""

import json

import numpy as np

from tests.distributed.test_train import memfit_train, read

TEXT = "the quick brown fox jumps over the lazy dog. " * 400
FACTORY = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ff = nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.relu(self.ff(x))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(300, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(16, 300)

    def forward(self, input_ids, labels=None):
        x = self.embed(input_ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)  # logits: memfit computes the next-token loss


def build():
    return Tiny()
"""


def make_tokenizer(text_file, path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train([str(text_file)], trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"]))
    tok.save(str(path))


def test_hf_config_text_tokenizer_eval_and_logs(tmp_path):
    from transformers import GPT2Config

    (tmp_path / "corpus.txt").write_text(TEXT)
    make_tokenizer(tmp_path / "corpus.txt", tmp_path / "tokenizer.json")
    GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=320, bos_token_id=0, eos_token_id=0).save_pretrained(
        tmp_path / "model"
    )
    config = tmp_path / "run.toml"
    config.write_text(
        f'model = "{tmp_path / "model" / "config.json"}"\ndata = "{tmp_path / "corpus.txt"}"\n'
        f'tokenizer = "{tmp_path / "tokenizer.json"}"\nsteps = 9\neval-every = 2\nval-fraction = 0.2\n'
    )
    metrics = tmp_path / "metrics.jsonl"
    proc = memfit_train(
        "--config", str(config), "--steps", "4", "--metrics", str(metrics), "--log-every", "2",
        "--json", str(tmp_path / "run.json"), preset=False,
    )  # fmt: skip
    out = proc.stdout
    assert "world size 1" in out and "global batch 4 sequences of 16 tokens" in out and "M parameters" in out
    assert "tokenizer.json: " in out and " ids)" in out
    assert "| grad norm " in out and "| ETA " in out and "tok/s" in out
    assert "eval at step 2 | val loss" in out and "eval at step 4 | val loss" in out
    result = read(tmp_path / "run.json")
    assert [e["step"] for e in result["log"]] == [1, 2, 3, 4]  # --steps overrides the file's 9
    assert [e["step"] for e in result["eval"]] == [2, 4]
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    logged = [e for e in lines if "loss" in e]
    assert [e["step"] for e in logged] == [2, 4]  # step 2 also measures the peak (AdamW state exists)
    assert {"lr", "grad_norm", "tokens_per_s", "world_size", "global_batch", "params"} <= logged[0].keys()
    assert "peak_bytes" in logged[0]
    assert [e["step"] for e in lines if "val_loss" in e] == [2, 4]


def test_factory_model_and_nanogpt_bin(tmp_path):
    (tmp_path / "user_models.py").write_text(FACTORY)
    np.random.default_rng(0).integers(0, 300, 5000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.save(tmp_path / "ids.npy", np.arange(3000, dtype=np.int32) % 290)
    for data in ("train.bin", "ids.npy"):
        proc = memfit_train(
            "--model", "user_models:build", "--data", str(tmp_path / data), "--steps", "2",
            "--checkpointing", "keep", "--json", str(tmp_path / "f.json"), env_path=str(tmp_path),
            preset=False,
        )  # fmt: skip
        assert [e["step"] for e in read(tmp_path / "f.json")["log"]] == [1, 2], proc.stdout
    proc = memfit_train("--model", "gpt2", "--data", str(tmp_path / "nothing.txt"), check=False)
    assert proc.returncode == 2 and "no such file or directory" in proc.stderr


def test_tensorboard_is_optional(tmp_path):
    proc = memfit_train("--steps", "1", "--tensorboard", str(tmp_path / "tb"))
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        assert "needs the tensorboard package" in proc.stderr
    else:
        assert any((tmp_path / "tb").iterdir())
