"""What ``--model`` names in `memfit bench`, `memfit plan` and `memfit train`: a preset, a local
HF ``config.json`` (or a directory holding one), or a Python factory. :func:`resolve` is the one
place that reads the spec; every command calls it.

Nothing is downloaded. A preset or a config is built randomly initialised with
``transformers``'s Auto classes (masked LM for BERT-like configs, causal LM otherwise); a
factory ``pkg.module:function`` is called with no arguments after seeding torch and must
return an ``nn.Module`` (see :func:`loss_of` for what its forward may return).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

MASKED = ("bert", "roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2")


@dataclass(frozen=True)
class ModelSpec:
    """How to build the model `--model` names, and what the trainer needs to know about it."""

    name: str  # as the user wrote it
    arch: str  # "bert" (masked LM: 15% of tokens masked and predicted) or "causal" (next token)
    build: Callable[[int], nn.Module]  # seed -> a randomly initialised model
    seq: int  # default sequence length (a preset's; 128, or the config's max positions if fewer)
    batch: int  # default micro-batch rows per rank (a preset's; 8 otherwise)
    about: str = ""  # what it is, for a command's header ("gpt2 Shape(...)", "llama from my/config.json")


def resolve(
    name: str,
    *,
    layers: int | None = None,
    hidden: int | None = None,
    seq: int | None = None,
    batch: int | None = None,
    command: str = "memfit train",
) -> ModelSpec:
    """The ModelSpec of ``name``: a preset name, a path to a ``config.json`` (or a directory
    holding one), or ``pkg.module:function``. ``layers``/``hidden`` resize presets only;
    ``seq``/``batch`` replace the defaults of any; ``command`` starts the error messages."""
    from memfit.models import PRESETS

    if name in PRESETS:
        preset = PRESETS[name].resized(layers=layers, hidden=hidden, seq=seq, batch=batch)
        arch = "bert" if preset.arch == "bert" else "causal"
        about = f"{preset.arch} {preset.resolved()}"
        return ModelSpec(name, arch, preset.build, preset.shape.seq, preset.shape.batch, about)
    is_config = os.path.isdir(name) or name.endswith(".json")
    if not is_config and ":" not in name:
        raise ValueError(
            f"{command}: unknown model {name!r}; choose one of {sorted(PRESETS)}, a local config.json path "
            "(or a directory holding one), or a factory as pkg.module:function"
        )
    if layers or hidden:
        raise ValueError(f"{command}: --layers and --hidden resize presets; edit the config or factory instead")
    spec = _from_config(name, command) if is_config else _from_factory(name, command)
    return dataclasses.replace(spec, seq=seq or spec.seq, batch=batch or spec.batch)


def _from_config(path: str, command: str) -> ModelSpec:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ValueError(f"{command}: --model {path!r}: no such file {file!r}")
    try:
        config = AutoConfig.from_pretrained(file)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{command}: --model {path!r} is not a transformers config.json ({e})") from None
    masked = config.model_type in MASKED
    auto = AutoModelForMaskedLM if masked else AutoModelForCausalLM
    if type(config) not in auto._model_mapping:  # a vision or audio config: refused here, in one line
        head = "masked" if masked else "causal"
        raise ValueError(
            f"{command}: --model {path!r} is a {config.model_type} config ({type(config).__name__}), which "
            f"transformers builds no {head} language model for; memfit trains language models: pass a causal LM "
            "config (gpt2, llama, qwen2, mistral, ...), a masked LM config (bert, roberta, ...), a preset, or a "
            "factory pkg.module:function that returns your model"
        )
    if hasattr(config, "use_cache"):
        config.use_cache = False

    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return auto.from_config(config)

    positions = _max_positions(config)
    seq = min(128, positions) if positions else 128
    return ModelSpec(path, "bert" if masked else "causal", build, seq, 8, f"{config.model_type} from {file}")


def _max_positions(config) -> int | None:
    """The longest sequence a transformers config embeds positions for, when it says."""
    for key in ("max_position_embeddings", "n_positions"):
        if isinstance(getattr(config, key, None), int):
            return int(getattr(config, key))
    return None


def _from_factory(spec: str, command: str) -> ModelSpec:
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{command}: cannot import the model factory {spec!r}: {e}") from None

    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        model = factory()
        if not isinstance(model, nn.Module):
            raise TypeError(f"{command}: {spec} returned {type(model).__name__}, not a torch.nn.Module")
        return model

    return ModelSpec(spec, "causal", build, 128, 8, f"what {spec}() returns")


def layer_class(model: nn.Module) -> type[nn.Module]:
    """The class of the model's repeated blocks, the units to shard and checkpoint: of the
    transformers ``_no_split_modules`` classes, the most frequent (those kept in an nn.ModuleList
    first: BERT lists BertEmbeddings there too, and the first one found is not the block); else
    the class of the longest ModuleList's items."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [type(m) for m in model.modules() if type(m).__name__ in names]
    in_lists = {type(m) for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst}
    listed = [c for c in found if c in in_lists] or found
    if listed:
        return max(dict.fromkeys(listed), key=listed.count)
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(
            f"memfit: cannot find the repeated blocks of {type(model).__name__} (no nn.ModuleList); "
            "keep the blocks in an nn.ModuleList"
        )
    return type(max(lists, key=len)[0])


def settle_loss_type(model: nn.Module) -> None:
    """Name the loss of a transformers model whose class name names none (``GPT2LMHeadModel``:
    ``loss_type`` None), as the one transformers falls back to for it, ``ForCausalLM``: the same
    loss, without transformers' warning on every run that it fell back."""
    if "loss_type" in vars(model) and model.loss_type is None:
        model.loss_type = "ForCausalLM"


def vocab_size(model: nn.Module) -> int | None:
    """The number of token ids ``model`` embeds, when it says (HF config or input embeddings)."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "vocab_size", None):
        return int(config.vocab_size)
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    return embeddings[0].num_embeddings if embeddings else None


def loss_of(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss of ``model(input_ids=..., labels=...)``: its ``.loss`` (transformers), a scalar
    it returns, or, from logits ``[batch, seq, vocab]``, the next-token cross-entropy."""
    out = model(**batch)
    loss = getattr(out, "loss", None)
    if loss is not None:
        return loss
    if torch.is_tensor(out) and out.dim() == 0:
        return out
    logits = out if torch.is_tensor(out) else getattr(out, "logits", None)
    if logits is None or logits.dim() != 3:
        raise TypeError(
            "memfit train: the model's forward(input_ids=, labels=) must return a loss, an object with .loss, "
            f"or logits [batch, seq, vocab]; it returned {type(out).__name__}"
        )
    labels = batch["labels"][:, 1:]
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels.reshape(-1))
