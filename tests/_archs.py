"""Every architecture in transformers' auto mappings, built tiny: configs, batches, a step.

Used by tests/integration/test_archs.py; ``python -m tests._archs [names]`` prints one line per
architecture (trained, skipped and why, checkpointing equal or not) and the counts;
``python -m tests._archs --plan [names]`` the same for the planner's forecast (its ratio to the
measured peak of the second AdamW step).
"""

from __future__ import annotations

import copy
import dataclasses
import random
import signal
import sys
import time
import traceback

import numpy
import torch

# Task -> the auto mapping of model type -> class name it enumerates.
MAPPINGS = {
    "causal_lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked_lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq2seq_lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "image_classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "speech_seq2seq": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
}
VOCAB, SEQ, BATCH, IMAGE = 128, 16, 2, 32
SECONDS = 60  # one architecture's three steps; tiny ones take about a second
# Architectures whose tiny config is small but slow on a CPU (reference implementations of their
# linear-attention kernels, 30-60 s on a loaded machine): model type -> seconds allowed.
SLOW_SECONDS = {
    "bailing_hybrid": 300,
    "kimi_linear": 300,
    "hrm_text": 300,  # 32 blocks: ~90 s to plan alone here
    "zamba": 300,  # its Mamba scan in Python (no mamba_ssm): ~100 s to plan on a loaded machine
}
MAX_PARAMS = 5_000_000  # a tiny config above this was not shrunk (a size the shrinker does not know)


class ShrinkError(Exception):
    """The shrinker left the model large or slow: a failure of the test's shrinker, not a skip."""


@dataclasses.dataclass(frozen=True)
class Arch:
    task: str
    model_type: str
    class_name: str

    @property
    def id(self) -> str:
        return f"{self.task}-{self.class_name}"


def architectures() -> list[Arch]:
    """Each (task, class) of the mappings at the installed transformers, once, sorted."""
    from transformers.models.auto import modeling_auto

    seen: dict[tuple[str, str], Arch] = {}
    for task, name in MAPPINGS.items():
        for model_type, cls in getattr(modeling_auto, name).items():
            for c in [cls] if isinstance(cls, str) else cls:
                seen.setdefault((task, c), Arch(task, model_type, c))
    return sorted(seen.values(), key=lambda a: a.id)


# [Note: Tiny configs]
# A config class's defaults are its published model (billions of parameters); the shrinker sets
# the sizes that scale it on every config and sub-config (text, vision, audio, encoder,
# decoder): widths to 32, 4 heads (2 key/value heads) of 8, 2 layers, 64-wide feed-forward, a
# 128-token vocabulary (token ids outside it moved in), 4 experts (2 per token), 32-pixel
# images, and 0.1 for every dropout, so that recompute has random masks to replay. Lists of
# per-stage sizes (a ResNet's hidden_sizes and depths) keep their length. Everything else stays
# the class default; OVERRIDES lists what a model needs beyond that.
_WIDTH = ("hidden_size", "d_model", "n_embd", "dim", "emb_dim", "embed_dim", "hidden_dim", "d_embed", "n_embed")
_WIDTH += ("word_embed_proj_dim", "projection_dim", "embedding_size", "text_embed_dim", "vision_embed_dim")
_WIDTH += ("encoder_hidden_size", "decoder_hidden_size", "d_inner_hidden")
_LAYERS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers")
_LAYERS += ("num_decoder_layers", "num_encoder_layers", "depth", "n_layers_per_block")
_HEADS = ("num_attention_heads", "n_head", "n_heads", "encoder_attention_heads", "decoder_attention_heads")
_HEADS += ("num_heads", "num_decoder_attention_heads", "encoder_num_attention_heads")
_FFN = ("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "n_inner", "d_ff", "d_inner")
_FFN += ("moe_intermediate_size", "shared_expert_intermediate_size", "ffn_hidden_size", "mlp_dim")
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_experts_routed")
_SMALL = {
    **dict.fromkeys(_WIDTH, 32),
    **dict.fromkeys(_LAYERS, 2),
    **dict.fromkeys(_HEADS, 4),
    **dict.fromkeys(_FFN, 64),
    **dict.fromkeys(_EXPERTS, 4),
    "num_key_value_heads": 2,
    "head_dim": 8,
    "kv_channels": 8,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "top_k": 2,
    "n_shared_experts": 1,
    "vocab_size": VOCAB,
    "decoder_vocab_size": VOCAB,
    "image_size": IMAGE,
    "max_source_positions": SEQ,
    "num_mel_bins": 16,
    # multi-head latent attention (DeepSeek): ranks and the rotary / non-rotary halves of a head
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4,
    "v_head_dim": 8,
    "rotary_dim": 8,
    "n_group": 1,
    "topk_group": 1,
    "moe_k": 2,
    "num_experts_per_token": 2,
    # state-space layers: heads x head width = expand x hidden
    "mamba_n_heads": 4,
    "mamba_d_head": 16,
    "mamba_d_state": 16,
    "mamba_n_groups": 1,
    "mamba_expand": 2,
    "mamba_d_ssm": 64,
    "mamba_chunk_size": 16,
    "chunk_size": 16,
    "d_state": 16,
    "state_size": 16,
}
_TOKENS = {"pad_token_id": VOCAB - 1, "bos_token_id": VOCAB - 2, "eos_token_id": VOCAB - 3}  # ids outside moved in
_SEAMLESS = {
    "speech_encoder_layers": 2,
    "speech_encoder_attention_heads": 4,
    "speech_encoder_intermediate_size": 64,
    "feature_projection_input_dim": 80,
}
# Model-specific settings the generic shrinker cannot guess (model type -> attributes; a dict for a
# sub-config, such as "text_config", sets that sub-config's attributes).
OVERRIDES: dict[str, dict] = {
    "diffllama": {"attention_dropout": 0.0},  # raises for attention dropout (no defined semantics)
    # a byte-group hash table of 500002 rows per n-gram size; the global width of the local models
    "blt": {
        "encoder_hash_byte_group_vocab": 64,
        "encoder_config": {"hidden_size_global": 32},
        "decoder_config": {"hidden_size_global": 32},
        "global_config": {"encoder_cross_output_size": 64},  # local width x cross_attn_k (set at init)
    },
    # per-layer token embeddings: their own vocabulary and width
    "gemma4_text": {"vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8},
    "gemma4": {"text_config": {"vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8}},
    # 256 "zero" (identity) experts beside the routed ones; the experts' width under its own name
    "longcat_flash": {"zero_expert_num": 2, "expert_ffn_hidden_size": 64},
    # the audio encoder's conformer blocks and convolution channels
    "phi4_multimodal": {
        "audio_config": {
            "num_blocks": 2,
            "nemo_conv_channels": 16,
            "ext_pw_out_channel": 32,
            "depthwise_separable_out_channel": 32,
        }
    },
    "recurrent_gemma": {"lru_width": 32},  # the recurrent layer's width (the hidden size, published)
    # pronunciation and glyph-shape embeddings: their own vocabularies and widths
    "roc_bert": {
        "shape_vocab_size": 64,
        "shape_embed_dim": 16,
        "pronunciation_vocab_size": 64,
        "pronunciation_embed_dim": 16,
    },
    # the shared attention's sizes and the layer kinds are derived from the published sizes at init
    "zamba": {
        "layers_block_type": ["linear_attention", "hybrid"] * 2,
        "num_hidden_layers": 4,
        "attention_hidden_size": 64,  # 2 x hidden
        "attention_head_dim": 16,  # 2 x hidden / heads
        "mamba_dt_rank": 2,  # hidden / 16
    },
    "zamba2": {
        "layers_block_type": ["linear_attention", "hybrid"] * 2,
        "hybrid_layer_ids": [1, 3],
        "num_hidden_layers": 4,
        "attention_hidden_size": 64,  # 2 x hidden
        "attention_head_dim": 16,  # 2 x hidden / heads
        "mamba_headdim": 8,  # expand x hidden / mamba heads
        "num_query_groups": 4,  # heads
        "adapter_rank": 8,
    },
    # per-stage sizes under other names
    "cvt": {"embed_dim": (16, 32, 64), "depth": (1, 2, 3)},  # transformers reads stage k's k-th drop-path rate
    # a width multiplier (channels rounded to 8) and a depth multiplier; hidden_dim is the top
    # convolution's channels, round_filters(1280)
    "efficientnet": {"width_coefficient": 0.05, "depth_coefficient": 1.0, "hidden_dim": 64},
    # each stage's channels (in = the previous stage's out; the classifier reads hidden_sizes[-1])
    "hgnet_v2": {
        "stem_channels": (3, 8, 16),
        "stage_in_channels": (16, 16, 32, 64),
        "stage_mid_channels": (8, 8, 16, 16),
        "stage_out_channels": (16, 32, 64, 64),
        "stage_num_blocks": (1, 1, 2, 1),
        "hidden_sizes": [16, 32, 64, 64],
        "embedding_size": 16,
    },
    # the latent array (latents x width) and its self-attention blocks
    "perceiver": {
        "num_latents": 16,
        "d_latents": 32,
        "num_self_attends_per_block": 2,
        "num_self_attention_heads": 4,
        "num_cross_attention_heads": 4,
        "max_position_embeddings": SEQ,  # the masked LM's decoder outputs this many positions
    },
    "luke": {"entity_vocab_size": 64, "entity_emb_size": 16},  # the entity vocabulary and width
    # the language model (Nemotron-H): its published 52-layer pattern (one layer of each kind
    # here) and its Mamba heads, under their own names
    "nemo_speechlm": {
        "text_config": {
            "layers_block_type": ["linear_attention", "moe", "full_attention"],
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,  # heads x head width = expand x hidden
            "n_groups": 1,
            "ssm_state_size": 16,
            "moe_shared_expert_intermediate_size": 64,
        }
    },
    # the decoder's cross-attention over the encoder, sized under its own names
    "dia": {
        "decoder_config": {
            "cross_hidden_size": 32,  # the encoder's width
            "cross_num_attention_heads": 4,
            "cross_num_key_value_heads": 4,
            "cross_head_dim": 8,
        }
    },
    # the speech encoder (a conformer) under its own names; 80 features a frame, as batch_for gives
    "seamless_m4t": _SEAMLESS,
    "seamless_m4t_v2": _SEAMLESS,
    # the audio tokenizers' convolution stages double num_filters each (2048 channels at the last)
    "vibevoice_asr": {
        "acoustic_tokenizer_encoder_config": {"num_filters": 2},
        "semantic_tokenizer_encoder_config": {"num_filters": 2},
    },
    "vibevoice": {
        "audio_config": {"num_filters": 2},
        "semantic_model_config": {"num_filters": 2},
        "diffusion_head_config": {"frequency_embedding_size": 32, "latent_size": 32},  # the tokenizer's width
    },
}


def _shrink(cfg, depth: int = 0) -> None:
    from transformers import PretrainedConfig

    for key, value in list(vars(cfg).items()):
        if isinstance(value, PretrainedConfig) and depth < 3:
            _shrink(value, depth + 1)
        elif key in _SMALL and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            setattr(cfg, key, min(value, _SMALL[key]))
        elif key in ("hidden_sizes", "embed_dims", "dims") and _int_list(value):
            setattr(cfg, key, [8 * 2**i for i in range(len(value))])
        elif key in ("depths", "num_layers_per_stage") and _int_list(value):
            setattr(cfg, key, [1] * len(value))
        elif key in ("num_heads", "num_attention_heads") and _int_list(value):
            setattr(cfg, key, [1] * len(value))
        elif key == "use_cache":  # see [Note: Key/value caches under recompute]
            setattr(cfg, key, False)
        elif "dropout" in key and isinstance(value, float):
            setattr(cfg, key, 0.1)
        elif key.endswith("token_id") and isinstance(value, int) and value >= VOCAB:
            setattr(cfg, key, _TOKENS.get(key, 3))
    _layer_types(cfg)
    if isinstance(getattr(cfg, "qk_rope_head_dim", None), int):  # MLA: the rotary part is the "head_dim"
        for key in ("head_dim", "qk_head_dim"):
            if key in vars(cfg):
                setattr(cfg, key, cfg.qk_rope_head_dim if key == "head_dim" else 8)
        # MLA expands keys and values to every head (published configs: as many key/value heads as
        # heads); fewer makes transformers repeat them again when an attention mask is given.
        if isinstance(getattr(cfg, "num_key_value_heads", None), int) and "num_attention_heads" in vars(cfg):
            cfg.num_key_value_heads = cfg.num_attention_heads


def _layer_types(cfg) -> None:
    """A per-layer list of kinds (sliding, full, linear attention): one layer of each kind."""
    kinds = getattr(cfg, "layer_types", None)
    if "layer_types" not in vars(cfg):  # a property computed from other fields
        return
    if isinstance(kinds, (list, tuple)) and kinds and all(isinstance(k, str) for k in kinds):
        distinct = list(dict.fromkeys(kinds))
        cfg.layer_types = distinct if len(distinct) > 1 else distinct * 2
        for key in ("num_hidden_layers", "num_layers", "n_layer"):
            if isinstance(getattr(cfg, key, None), int):
                setattr(cfg, key, len(cfg.layer_types))


def _int_list(value) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, int) for v in value)


def tiny_config(arch: Arch):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(arch.model_type)
    _shrink(cfg)
    _override(cfg, OVERRIDES.get(arch.model_type, {}))
    return cfg


def _override(cfg, values: dict) -> None:
    """Set the attributes of ``values`` on ``cfg``; a dict for a sub-config sets its attributes."""
    from transformers import PretrainedConfig

    for key, value in values.items():
        if isinstance(value, dict) and isinstance(getattr(cfg, key, None), PretrainedConfig):
            _override(getattr(cfg, key), value)
        else:
            setattr(cfg, key, value)


def build(arch: Arch, seed: int = 0) -> torch.nn.Module:
    import transformers

    cls = getattr(transformers, arch.class_name)
    cfg = tiny_config(arch)
    with torch.device("meta"):
        size = sum(p.numel() for p in cls(cfg).parameters())
    if size > MAX_PARAMS:
        raise ShrinkError(f"{size / 1e6:.1f}M parameters after shrinking; add it to OVERRIDES")
    torch.manual_seed(seed)
    model = cls(cfg)
    return model.train()


def batch_for(arch: Arch, model: torch.nn.Module) -> dict:
    """One batch for the task: token ids and labels, images and classes, or audio features."""
    cfg = model.config
    g = torch.Generator().manual_seed(1)
    vocab = min(VOCAB, getattr(cfg.get_text_config(), "vocab_size", VOCAB) or VOCAB)
    ids = torch.randint(4, vocab - 4, (BATCH, SEQ), generator=g)
    if arch.task in ("causal_lm", "masked_lm"):
        return {"input_ids": ids, "labels": ids.clone()}
    # Decoder inputs given, not derived from the labels (some configs have no decoder start id).
    decoder = {"decoder_input_ids": ids[:, : SEQ // 2].flip(1).clone(), "labels": ids[:, : SEQ // 2].clone()}
    if arch.task == "seq2seq_lm":
        return {"input_ids": ids, **decoder}
    if arch.task == "image_classification":
        size = getattr(cfg, "image_size", IMAGE)
        size = size[0] if isinstance(size, (list, tuple)) else size
        channels = getattr(cfg, "num_channels", 3)
        labels = torch.randint(0, cfg.num_labels, (BATCH,), generator=g)
        return {"pixel_values": torch.randn(BATCH, channels, size, size, generator=g), "labels": labels}
    if model.main_input_name == "input_features":
        if hasattr(cfg, "num_mel_bins"):  # Whisper-like: (batch, mel bins, 2 x source positions)
            frames = 2 * cfg.max_source_positions
            return {"input_features": torch.randn(BATCH, cfg.num_mel_bins, frames, generator=g), **decoder}
        width = getattr(cfg, "input_feat_per_channel", 80) * getattr(cfg, "input_channels", 1)
        return {"input_features": torch.randn(BATCH, 64, width, generator=g), **decoder}
    return {model.main_input_name: torch.randn(BATCH, 4000, generator=g), **decoder}


def step(model: torch.nn.Module, batch: dict, seed: int = 3) -> tuple[torch.Tensor, list]:
    """Loss and gradients (None where none) of one forward and backward under ``seed``."""
    torch.manual_seed(seed)
    random.seed(seed)
    numpy.random.seed(seed)  # SpecAugment's time masks (wav2vec2, SpeechT5) draw from numpy
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def blocks(model: torch.nn.Module) -> list[str]:
    """The repeated blocks the planner would decide for (its candidates)."""
    from memfit._plan._candidates import find_candidates

    return [p for p, _ in find_candidates(model)]


def checkpointed_step(model, batch, paths, save) -> tuple[torch.Tensor, list]:
    import memfit

    for p in paths:
        memfit.checkpoint_module(model.get_submodule(p), save=save, name=p)
    return step(model, batch)


def differences(a, b) -> list[int]:
    """Indices of the gradients that differ (bitwise, or one None and not the other)."""
    out = []
    for i, (x, y) in enumerate(zip(a, b)):
        if (x is None) != (y is None) or (x is not None and not torch.equal(x, y)):
            out.append(i)
    return out


def _reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def check(arch: Arch) -> dict:
    """Build, train plainly (skip if that fails), then full and selective checkpointing; on one
    thread (tiny ops on a shared machine run 20x slower on all its threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    previous = signal.signal(signal.SIGALRM, _too_slow)
    signal.alarm(SLOW_SECONDS.get(arch.model_type, SECONDS))
    try:
        return _check(arch)
    except ShrinkError as e:
        return {"status": "fail", "reason": f"{arch.class_name}: {e}"}
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        torch.set_num_threads(threads)


def _too_slow(signum, frame):
    raise ShrinkError(f"over {SECONDS} s: a size the shrinker does not know; add it to OVERRIDES")


def _check(arch: Arch) -> dict:
    try:
        model = build(arch)
        batch = batch_for(arch, model)
        loss, grads = step(copy.deepcopy(model), batch)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss {loss.item()}")
    except ShrinkError:
        raise
    except Exception as e:  # plain transformers cannot train it: skipped with the reason
        return {"status": "skip", "reason": _reason(e)}
    try:
        paths = blocks(model)
    except ValueError as e:  # no run of two or more same-class blocks (ALBERT shares one layer)
        return {"status": "skip", "reason": f"nothing to checkpoint: {_reason(e)}"}
    result: dict = {"status": "pass", "blocks": len(paths)}
    for save in (None, "linear"):
        try:
            l2, g2 = checkpointed_step(copy.deepcopy(model), batch, paths, save)
            bad = differences(grads, g2)
            if not torch.equal(loss, l2) or bad:
                names = [n for i, (n, _) in enumerate(model.named_parameters()) if i in bad][:3]
                raise AssertionError(f"loss {loss.item()} vs {l2.item()}; {len(bad)} grads differ {names}")
        except ShrinkError:
            raise
        except Exception as e:  # reported by the test
            result["status"] = "fail"
            result[f"save={save}"] = _reason(e) if not isinstance(e, AssertionError) else str(e)
            result.setdefault("trace", traceback.format_exc(limit=-3))
    return result


# [Note: Initialised like eager]
# memfit.materialize of a model built on the meta device is compared with the eager build of the
# same config: the same keys; constants (integer tensors, one element, or zero spread: norms 1,
# biases 0) and rotary tables exact; everything else finite with its standard deviation within
# max(5%, 6/sqrt(n)) of the eager one's. Two samples of n draws of one distribution differ in
# std by about 1/sqrt(n) relative (one standard error), so 6 of them is no tighter than the
# arithmetic, and a wrong init (std 1 or 0.07 for 0.02; a tied head's std for its embedding's)
# is several times outside it for every tensor of 128 elements or more.
def assert_like_eager(want: dict, got: dict, what: str) -> None:
    assert set(got) == set(want), f"{what}: keys differ {sorted(set(got) ^ set(want))[:4]}"
    for name, e in want.items():
        g = got[name]
        g = g.full_tensor() if hasattr(g, "full_tensor") else g
        if not e.is_floating_point() or e.numel() < 2 or e.std() == 0 or name.endswith(_TABLES):
            assert torch.equal(g, e), f"{what} {name}: {g.flatten()[:4]} vs {e.flatten()[:4]}"
            continue
        assert torch.isfinite(g).all(), f"{what} {name}: not finite"
        se, sg = e.std().item(), g.std().item()
        tol = max(0.05, 6 / e.numel() ** 0.5)
        assert abs(sg - se) <= tol * se, f"{what} {name}: std {sg:.4g}, eager {se:.4g} ({e.numel()} elements)"


_TABLES = ("inv_freq", "_cos_cached", "_sin_cached")


def materialized(arch: Arch, eager: torch.nn.Module) -> torch.nn.Module:
    """The config of ``eager`` built on the meta device, sharded (its ``_no_split_modules``
    blocks, then the root) in the current process group, and materialized."""
    import transformers

    import memfit

    with torch.device("meta"):
        meta = getattr(transformers, arch.class_name)(tiny_config(arch))
    names = set(eager._no_split_modules or ())
    blocks = {type(m) for m in meta.modules() if type(m).__name__ in names}
    return memfit.materialize(memfit.FullyShardedDataParallel(meta, auto_wrap_policy=blocks))


def plan_check(arch: Arch) -> dict:
    """memfit.plan on the architecture (default candidates, a budget nothing constrains, the
    "cpu" profile) and its forecast of the second AdamW step's peak against MemoryMeter's measure
    (``ratio``); skipped where plain transformers cannot train it; on one thread, in SECONDS."""
    import memfit
    from memfit._plan._profile import _layerdrop_off

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    previous = signal.signal(signal.SIGALRM, _too_slow)
    signal.alarm(2 * SLOW_SECONDS.get(arch.model_type, SECONDS))
    try:
        try:
            model = build(arch)
            batch = batch_for(arch, model)
            step(copy.deepcopy(model), batch)
        except ShrinkError:
            raise
        except Exception as e:
            return {"status": "skip", "reason": _reason(e)}
        try:
            plan = memfit.plan(model, batch, budget="1TB", device_profile="cpu")
            _layerdrop_off(model)  # the plan is for the step that runs every layer: measure that one
            ratio = plan.predicted_peak / plan.measure(model, batch)
        except ShrinkError:
            raise
        except Exception as e:
            return {"status": "fail", "reason": _reason(e), "trace": traceback.format_exc(limit=-3)}
        status = "pass" if 1.0 <= ratio <= 1.03 else "under" if ratio < 1.0 else "over"
        return {"status": status, "ratio": round(ratio, 4), "blocks": len(plan.decisions)}
    except ShrinkError as e:
        return {"status": "shrink", "reason": str(e)}
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        torch.set_num_threads(threads)


def _deterministic(model: torch.nn.Module) -> None:
    """Dropout and LayerDrop off (in the modules and their configs): the halves of a batch on two
    ranks draw other random numbers than the whole batch in one process."""
    from memfit._plan._profile import _layerdrop_off

    _layerdrop_off(model)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for owner in (m, getattr(m, "config", None)):
            for name, value in list(vars(owner).items()) if owner is not None else []:
                if "dropout" in name and isinstance(value, float):
                    setattr(owner, name, 0.0)


def _sgd_update(model: torch.nn.Module, batch: dict) -> None:
    torch.manual_seed(3)
    numpy.random.seed(3)
    model(**batch).loss.backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()


def shard_check(arch: Arch, rank: int, world: int) -> dict:
    """One SGD step (lr 1: the update is the gradient) of the architecture sharded over the
    ranks (memfit.FullyShardedDataParallel, its _no_split_modules blocks as units), of DDP,
    each rank on its rows of the batch, and of one process on the whole batch: memfit's
    largest distance from the one process within twice DDP's plus 1e-5 of the largest update
    (the halves and the reduction add their own rounding). Dropout and LayerDrop off."""
    import memfit

    try:
        model = build(arch)
        _deterministic(model)
        batch = batch_for(arch, model)
        whole = copy.deepcopy(model)
        _sgd_update(whole, batch)
    except ShrinkError:
        raise
    except Exception as e:  # transformers cannot build or train it at its tiny config
        return {"status": "skip", "reason": _reason(e)}
    rows = BATCH // world
    mine = {
        k: v[rank * rows : (rank + 1) * rows] if torch.is_tensor(v) and len(v) == BATCH else v for k, v in batch.items()
    }
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
        _sgd_update(ddp, mine)
    except Exception as e:  # DDP fails on it (a half batch too small for it, ...): no reference
        return {"status": "skip", "reason": f"DDP: {_reason(e)}"}
    names = set(model._no_split_modules or ())
    units = {type(m) for m in model.modules() if type(m).__name__ in names}
    sharded = memfit.FullyShardedDataParallel(copy.deepcopy(model), auto_wrap_policy=units)
    try:
        _sgd_update(sharded, mine)
    except Exception as e:
        return {"status": "fail", "reason": _reason(e)}
    with memfit.summon_full_params(sharded, writeback=False):
        got = {n: p.detach().clone() for n, p in sharded.named_parameters()}
    start = dict(model.named_parameters())
    want = {n: p.detach() - start[n].detach() for n, p in whole.named_parameters()}

    def largest(ts) -> float:
        return max((t.abs().max().item() for t in ts if t.numel()), default=0.0)  # MobileBERT has a (0, 32)

    ddp_far = largest(p.detach() - start[n] - want[n] for n, p in ddp.module.named_parameters())
    far = largest(got[n] - start[n] - want[n] for n in want)
    scale = largest(want.values())
    status = "pass" if far <= 2 * ddp_far + 1e-5 * scale else "fail"
    return {"status": status, "memfit": far, "ddp": ddp_far, "largest": scale}


def shard_each(rank: int, world: int, ids: list[str]) -> dict[str, int]:
    """shard_check on each architecture of ``ids``, in a group of ``world`` ranks; rank 0 prints
    a line each; the counts by status."""
    counts: dict[str, int] = {}
    for arch in architectures():
        if arch.id not in ids:
            continue
        t0 = time.perf_counter()
        try:
            r = shard_check(arch, rank, world)
        except ShrinkError as e:
            r = {"status": "shrink", "reason": str(e)}
        counts[r["status"]] = counts.get(r["status"], 0) + 1
        if rank == 0:
            extra = {k: v for k, v in r.items() if k != "status"}
            print(f"{r['status']:5} {time.perf_counter() - t0:6.2f}s {arch.id} {extra}", flush=True)
    return counts


if __name__ == "__main__":
    planner = "--plan" in sys.argv
    # --part K/N: every N-th architecture from the K-th (0-based), to run N processes at once
    part = next((a.removeprefix("--part=") for a in sys.argv if a.startswith("--part=")), "0/1")
    k, n = map(int, part.split("/"))
    wanted = {a for a in sys.argv[1:] if not a.startswith("--")}
    counts: dict[str, int] = {}
    chosen = [
        arch
        for index, arch in enumerate(architectures())
        if index % n == k and (not wanted or arch.model_type in wanted or arch.class_name in wanted)
    ]
    if "--shard" in sys.argv:  # one group of two ranks (gloo) over the chosen architectures
        from tests._dist import run_ranks

        counts = run_ranks(shard_each, 2, [a.id for a in chosen], timeout=4 * 3600)[0]
        chosen = []
    for arch in chosen:
        t0 = time.perf_counter()
        r = plan_check(arch) if planner else check(arch)
        counts[r["status"]] = counts.get(r["status"], 0) + 1
        extra = {k: v for k, v in r.items() if k not in ("status", "trace")}
        print(f"{r['status']:5} {time.perf_counter() - t0:6.2f}s {arch.id} {extra}", flush=True)
    print(counts)
