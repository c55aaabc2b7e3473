"""pytorch/examples' FSDP T5 script (tests/distributed/_fsdp1_t5.py: transformer_auto_wrap_policy
on T5Block, MixedPrecision policies, torch's activation checkpointing, train/validation, the
checkpoint handler's FULL_STATE_DICT save on rank 0 and FSDP.full_optim_state_dict) run twice on
2 gloo ranks: as written, with torch's FSDP1, and with only its FSDP import changed to memfit's.
The train and validation losses and the two saved files (model and optimizer) are compared.

One change to the torch run: torch FSDP1 cannot save FULL_STATE_DICT with offload_to_cpu=True
when it computes on the CPU ("setStorage: ... out of bounds for storage of size 0": the
gathered parameter's ``.cpu()`` is no copy there, and it is freed before the save reads it), so
its run saves with offload_to_cpu=False, which on the CPU is the same state dict. The memfit run
keeps the example's policy.

Tolerances. fp32: the losses agree to 1e-6 (relative); the saved parameters to 1e-4 (measured: 1.4e-5) and the
Adam moments to 1e-6 (1.9e-8): the gradients are the same sums in another order (FSDP1 reduces one flat
buffer per unit, memfit its own), and AdamW turns a last-bit difference in a near-zero gradient
into up to lr of movement (lr * m / sqrt(v)). bf16 (bfSixteen: bf16 compute and reduction): a
last-bit difference is 2**-8 relative there; the losses agree to 2 bf16 steps (1e-2 relative),
and each of the 4 AdamW steps can then move an element by up to 2 * lr either way, so the
parameters agree to 8 * lr = 1.6e-2 (measured: 4.9e-3); the moments (5.7e-4 apart, of
magnitude 1e-2) are compared in shape and step only.
"""

import os
import sys
import types

import pytest
import torch
from torch.distributed.fsdp import FullStateDictConfig

from tests._dist import Subtests, case_id

SCRIPT = os.path.join(os.path.dirname(__file__), "_fsdp1_t5.py")
TORCH_IMPORT = "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
MEMFIT_IMPORT = "from memfit import FullyShardedDataParallel as FSDP\n"
LR, STEPS = 2e-3, 4  # the script's Config: 2 epochs of 2 steps


def script(flavour: str) -> types.ModuleType:
    """The T5 script as a module, with torch's FSDP import or (the one change) memfit's."""
    with open(SCRIPT) as f:
        source = f.read()
    assert source.count(TORCH_IMPORT) == 1
    if flavour == "memfit":
        source = source.replace(TORCH_IMPORT, MEMFIT_IMPORT)
    module = types.ModuleType(f"_fsdp1_t5_{flavour}")
    module.__file__ = SCRIPT
    sys.modules[module.__name__] = module  # the dataclass needs its module registered
    exec(compile(source, SCRIPT, "exec"), module.__dict__)
    if flavour == "torch":  # See the module docstring
        module.fullstate_save_policy = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
    return module


def run_both(rank, world, root, policy):
    out = {}
    for flavour in ("torch", "memfit"):
        module = script(flavour)
        save_dir = os.path.join(root, policy, flavour)
        os.makedirs(save_dir, exist_ok=True)
        cfg = module.Config(save_dir=save_dir, mixed_precision=getattr(module, policy))
        out[flavour] = module.main(rank, world, cfg)
    assert len(out["torch"]["losses"]) == STEPS  # per rank: 8 samples, batches of 4, 2 epochs
    return out["torch"], out["memfit"]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape and a.dtype == b.dtype
    return (a.double() - b.double()).abs().max().item()


def compare_files(ref, got, param_atol, moments_atol):
    model_ref, model_got = torch.load(ref["saved"][0]), torch.load(got["saved"][0])
    assert sorted(model_ref) == sorted(model_got)  # the same names: no wrapper prefixes
    worst = max(max_diff(model_ref[k], model_got[k]) for k in model_ref)
    assert worst <= param_atol, f"saved parameters differ by {worst:.3g}"
    if os.environ.get("MEMFIT_T5_REPORT"):
        print(f"max |param diff| {worst:.3g}", flush=True)
    optim_ref, optim_got = torch.load(ref["saved"][1]), torch.load(got["saved"][1])
    assert sorted(optim_ref["state"]) == sorted(optim_got["state"])  # keyed by names, as FSDP1
    moments = []
    for name, state in optim_ref["state"].items():
        assert state["step"] == optim_got["state"][name]["step"] == STEPS
        moments += [max_diff(state[k], optim_got["state"][name][k]) for k in ("exp_avg", "exp_avg_sq")]
    if os.environ.get("MEMFIT_T5_REPORT"):
        print(f"max |Adam moment diff| {max(moments):.3g}", flush=True)
    if moments_atol is not None:
        assert max(moments) <= moments_atol, f"saved Adam moments differ by {max(moments):.3g}"
    for g_ref, g_got in zip(optim_ref["param_groups"], optim_got["param_groups"], strict=True):
        assert sorted(g_ref.pop("params")) == sorted(g_got.pop("params"))  # FSDP1 orders them by flat parameter
        assert g_ref == g_got  # lr after the scheduler's steps, betas, ...


def case_fp32(rank, world, root):
    ref, got = run_both(rank, world, root, "fp32_policy")
    for key in ("losses", "train", "val"):
        torch.testing.assert_close(got[key], ref[key], rtol=1e-6, atol=0)
    if rank == 0:
        compare_files(ref, got, param_atol=1e-4, moments_atol=1e-6)


def case_bf16(rank, world, root):
    ref, got = run_both(rank, world, root, "bfSixteen")
    for key in ("losses", "train", "val"):
        torch.testing.assert_close(got[key], ref[key], rtol=1e-2, atol=0)
    if rank == 0:
        compare_files(ref, got, param_atol=8 * LR, moments_atol=None)


CASES = [case_fp32, case_bf16]
GROUP = Subtests(CASES, timeout=600)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("fsdp1_t5"))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_fsdp1_t5_script(root, case):
    pytest.importorskip("transformers")
    GROUP.check(case, 2, root)
