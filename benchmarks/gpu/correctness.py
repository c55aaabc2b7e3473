"""Part a: correctness on the device.

1. The test modules that opt into ``MEMFIT_TEST_DEVICE=cuda`` (``Subtests(...,
   on_test_device=True)``; W=1 on NCCL, larger worlds skip on one GPU), run by pytest in a
   subprocess. Smoke: collected only.
2. Checkpoint parity with CUDA dropout and bf16 autocast: a BERT-MLM (dropout 0.1) with every
   layer checkpointed full / selective / offload="cpu" against no checkpointing: loss and
   every gradient bitwise. Smoke: the CPU's RNG and bf16 autocast.
3. Activation offload to pinned memory: bytes each way and that the forward's host copies are
   pinned (part of 2's offload case).
4. Sharding with MixedPrecision(bf16, reduce fp32) and offload="cpu" against the same sharding
   without offload (first loss bitwise; parameters after 3 AdamW steps within 1e-4 relative,
   since the offloaded shards step on the host's kernels) and against fp32 plain (bf16
   tolerance).
5. The race probe (benchmarks/gpu/_probe.py): side streams delayed with torch.cuda._sleep,
   gradient accumulation, zero_grad(set_to_none=False); delayed == undelayed bitwise and
   == plain (fp32, relative 1e-6; bitwise reported).
6. Host syncs per step of a sharded, checkpointed, offloaded model: torch.cuda.set_sync_debug_mode
   "warn" (counted) and "error" (whether a step raises), and memfit.testing.HostSyncCounter
   (Python-level reads; the only count in smoke mode).
7. A short ``TORCH_CUDA_SANITIZER=1`` run of the race probe's workload in a subprocess
   (smoke: the same subprocess without the sanitizer).
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import warnings

import torch
from torch.distributed.tensor import DTensor

import memfit
from benchmarks.gpu._env import Env, fmt, goal
from benchmarks.gpu._probe import _sharded, build, race_probe
from benchmarks.gpu.bert import SMOKE
from memfit.models import Shape, bert_layer_class, bert_mlm, mlm_batch


def opted_in_modules(env: Env) -> list[str]:
    """Test modules whose sharding cases run on CUDA under MEMFIT_TEST_DEVICE=cuda."""
    found = []
    for path in sorted((env.repo / "tests").rglob("test_*.py")):
        if re.search(r"on_test_device\s*=\s*True", path.read_text()):
            found.append(str(path.relative_to(env.repo)))
    return found


def _subprocess(env: Env, cmd: list[str], extra_env: dict, timeout: float) -> tuple[int, str]:
    path = os.pathsep.join(filter(None, [str(env.repo), os.environ.get("PYTHONPATH")]))
    full_env = {**os.environ, "PYTHONPATH": path, **extra_env}
    try:
        proc = subprocess.run(
            cmd, cwd=env.repo, env=full_env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return -1, out + f"\n(timed out after {timeout:.0f}s)"
    return proc.returncode, proc.stdout + proc.stderr


def test_modules(env: Env) -> dict:
    modules = opted_in_modules(env)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *modules]
    if env.smoke:
        cmd.append("--collect-only")
    rc, out = _subprocess(env, cmd, {"MEMFIT_TEST_DEVICE": env.device.type}, timeout=150)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|tests? collected)", out)}
    return {"modules": modules, "returncode": rc, "counts": counts, "tail": out[-3000:]}


def checkpoint_parity(env: Env) -> dict:
    """Loss and gradients of each checkpoint decision against none, bitwise, under bf16 autocast."""
    from memfit.testing import host_offload_on_cpu, offload_stats

    shape = SMOKE if env.smoke else Shape(layers=4, hidden=256, heads=4, seq=128, batch=8, vocab=8192)
    base = bert_mlm(shape)  # dropout 0.1
    batch = {k: v.to(env.device) for k, v in mlm_batch(shape).items()}
    pinned_checks: list[bool] = []

    def grads(decision: memfit.Decision | None) -> tuple[torch.Tensor, dict]:
        model = copy.deepcopy(base).to(env.device).train()
        if decision is not None:
            decision.apply_to(model, bert_layer_class())
        torch.manual_seed(1)
        if env.cuda:
            torch.cuda.manual_seed(1)
        with env.autocast(torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        return loss.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}

    ref_loss, ref = grads(None)
    decisions = {
        "full": memfit.Decision("full"),
        "selective (matmul)": memfit.Decision("selective", save="matmul"),
        "offload cpu": memfit.Decision("offload", offload="cpu"),
        "offload disk": memfit.Decision("offload", offload="disk"),  # staged through pinned buffers
    }
    out = {}
    for name, d in decisions.items():
        if name == "offload cpu" and env.cuda:
            pinned_checks.append(_offload_pins(base, batch, env))
        offload_stats().reset()
        with host_offload_on_cpu() if (name.startswith("offload") and not env.cuda) else _null():
            loss, got = grads(d)
        stats = offload_stats()
        out[name] = {
            "loss_bitwise": torch.equal(loss, ref_loss),
            "grads_bitwise": ref.keys() == got.keys() and all(torch.equal(ref[n], got[n]) for n in ref),
            "d2h_bytes": stats.d2h_bytes,
            "h2d_bytes": stats.h2d_bytes,
        }
    out["offload_host_copies_pinned"] = pinned_checks[0] if pinned_checks else None
    return {"shape": str(shape), "dtype": "bf16 autocast", "cases": out}


def _null():
    import contextlib

    return contextlib.nullcontext()


def _offload_pins(base: torch.nn.Module, batch: dict, env: Env) -> bool | None:
    """Whether offload="cpu" copies through pinned host memory (CUDA only): after a step the
    pool of memfit/_checkpoint/_pinned.py holds buffers, every one page-locked
    (cudaHostRegister, or torch's pin_memory where CUDA refused)."""
    from memfit._checkpoint._host import offloader

    model = copy.deepcopy(base).to(env.device).train()
    memfit.Decision("offload", offload="cpu").apply_to(model, bert_layer_class())
    with env.autocast(torch.bfloat16):
        loss = model(**batch).loss
    loss.backward()
    pool = offloader(next(model.parameters()).device).pool
    buffers = [raw for bufs in pool.free.values() for _, raw in bufs]
    return bool(buffers) and all(raw.is_pinned() for raw in buffers)


def sharded_mixed_offload(env: Env) -> dict:
    """MixedPrecision(bf16) sharding, offload="cpu" vs not (bitwise) and vs fp32 plain (tolerance)."""
    width, blocks = (32, 2) if env.smoke else (512, 4)
    base = build(width, blocks)
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(4, 16, width, generator=g).to(env.device) for _ in range(3)]
    mp = memfit.MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32)

    def train(model: torch.nn.Module) -> tuple[list[float], dict]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for x in xs:
            loss = model(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        # full tensors on the host: the offloaded model's DTensors live on a CPU mesh, the other's on the device's
        state = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in model.state_dict().items()}
        return [v.item() for v in losses], {n: p.detach().float().cpu() for n, p in state.items()}

    def sharded(offload: str | None) -> torch.nn.Module:
        model = copy.deepcopy(base)
        for block in model[:-1]:
            memfit.shard(block, device=env.device, mixed_precision=mp, offload=offload)
        return memfit.shard(model, device=env.device, mixed_precision=mp, offload=offload)

    plain_losses, _ = train(copy.deepcopy(base).to(env.device))
    on_losses, on_params = train(sharded(None))
    off_losses, off_params = train(sharded("cpu"))
    rel = max(abs(a - b) / abs(b) for a, b in zip(on_losses, plain_losses))
    params_rel = max(
        ((off_params[n] - on_params[n]).norm() / on_params[n].norm().clamp_min(1e-30)).item() for n in on_params
    )
    return {
        "offload_first_loss_bitwise": off_losses[0] == on_losses[0],
        "offload_bitwise_losses": off_losses == on_losses,
        "offload_bitwise_params": all(torch.equal(off_params[n], on_params[n]) for n in on_params),
        "offload_params_max_rel_diff": params_rel,
        "bf16_vs_fp32_max_rel_loss": rel,
        "losses": {"plain fp32": plain_losses, "memfit bf16": on_losses, "memfit bf16 offload": off_losses},
    }


def sync_warnings(messages: list[str]) -> list[str]:
    """The first lines of the warnings ``set_sync_debug_mode("warn")`` gives for host syncs;
    not torch's own notice that the mode "is a prototype feature" (counted as a sync before)."""
    lines = [m.splitlines()[0] for m in messages if m]
    return [m for m in lines if "synchroniz" in m.lower() and "prototype feature" not in m.lower()]


def host_syncs(env: Env) -> dict:
    """Host syncs in one steady step (forward, backward, SGD) of the probe's sharded model."""
    from memfit.testing import HostSyncCounter, host_offload_on_cpu

    width = 32 if env.smoke else 512
    x = torch.randn(4, 16, width).to(env.device)
    with host_offload_on_cpu() if not env.cuda else _null():
        model = _sharded(build(width, 2), env.device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step():
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)

        step()
        step()
        env.sync()
        with HostSyncCounter() as counter:
            step()
        figures = {"python_reads": counter.count, "python_read_calls": counter.calls}
        if env.cuda:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    step()
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            syncs = sync_warnings([str(w.message) for w in caught])
            torch.cuda.set_sync_debug_mode("error")
            try:
                step()
                error = None
            except RuntimeError as e:
                error = str(e).splitlines()[0]
            finally:
                torch.cuda.set_sync_debug_mode(0)
            figures |= {"sync_debug_warnings": len(syncs), "sync_debug_first": syncs[:3], "error_mode": error}
    return figures


def sanitizer(env: Env) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.gpu._probe", *(["--cpu"] if not env.cuda else [])]
    extra = {"TORCH_CUDA_SANITIZER": "1"} if env.cuda else {}
    rc, out = _subprocess(env, cmd, extra, timeout=150)
    return {
        "sanitizer": bool(extra),
        "returncode": rc,
        "races_reported": out.count("CSAN detected"),
        "tail": out[-2000:],
    }


def run(env: Env) -> dict:
    figures, goals, md = {}, [], []
    checks = [
        ("tests", test_modules),
        ("checkpoint_parity", checkpoint_parity),
        ("sharded_mixed_offload", sharded_mixed_offload),
        ("race_probe", None),
        ("host_syncs", host_syncs),
        ("sanitizer", sanitizer),
    ]
    errors = {}
    for name, fn in checks:
        env.log(f"  a: {name}")
        try:
            if name == "race_probe":
                with env.process_group():
                    width, blocks, batch = (32, 2, 2) if env.smoke else (1024, 4, 8)
                    figures[name] = race_probe(env.device, width=width, blocks=blocks, batch=batch)
            elif name in ("sharded_mixed_offload", "host_syncs"):
                with env.process_group():
                    figures[name] = fn(env)
            else:
                figures[name] = fn(env)
        except Exception as e:  # one check's failure is recorded; the others still run
            import traceback

            errors[name] = traceback.format_exc()
            goals.append(goal(f"{name} ran", None, "no exception", False))
            env.log(f"  a: {name} failed: {e!r}")
        env.free()
    figures["errors"] = errors

    if t := figures.get("tests"):
        ok = t["returncode"] == 0
        goals.append(goal("opted-in test modules", t["counts"].get("failed", 0), "pytest exit 0, none failed", ok))
        md.append(f"- test modules ({', '.join(t['modules'])}): {t['counts']} (exit {t['returncode']})")
    if c := figures.get("checkpoint_parity"):
        md += [f"- checkpoint parity, {c['dtype']}, dropout 0.1, {c['shape']}:", ""]
        md += ["| decision | loss bitwise | grads bitwise | offload D2H MiB | H2D MiB |", "|---|---|---|---:|---:|"]
        for name, case in c["cases"].items():
            if isinstance(case, dict) and "loss_bitwise" in case:
                md.append(
                    f"| {name} | {fmt(case['loss_bitwise'])} | {fmt(case['grads_bitwise'])} "
                    f"| {case['d2h_bytes'] / 2**20:.1f} | {case['h2d_bytes'] / 2**20:.1f} |"
                )
                goals.append(
                    goal(
                        f"checkpoint {name} == none (bitwise)",
                        None,
                        "bitwise",
                        case["loss_bitwise"] and case["grads_bitwise"],
                    )
                )
        offloaded = c["cases"]["offload cpu"]["d2h_bytes"] > 0
        goals.append(
            goal("offload cpu moved activations to the host", c["cases"]["offload cpu"]["d2h_bytes"], "> 0", offloaded)
        )
        if (pinned := c["cases"]["offload_host_copies_pinned"]) is not None:
            goals.append(goal("offload host copies pinned", None, "every pool buffer is_pinned()", pinned))
        md.append("")
    if s := figures.get("sharded_mixed_offload"):
        md.append(
            f"- sharding MixedPrecision(bf16, reduce fp32), offload='cpu' vs not: losses bitwise "
            f"{fmt(s['offload_bitwise_losses'])}, parameters bitwise {fmt(s['offload_bitwise_params'])} "
            f"(max relative {s['offload_params_max_rel_diff']:.2e}); "
            f"bf16 vs fp32 plain: max relative loss difference {s['bf16_vs_fp32_max_rel_loss']:.2e}"
        )
        # The first step's loss is the same computation; after it the optimizer steps on the host
        # for the offloaded shards (CPU kernels, no fused multiply-add) and on the device otherwise.
        goals.append(goal("mixed + offload: first loss == mixed", None, "bitwise", s["offload_first_loss_bitwise"]))
        rel = s["offload_params_max_rel_diff"]
        goals.append(goal("mixed + offload: parameters after 3 steps vs mixed", rel, "<= 1e-4 relative", rel <= 1e-4))
        goals.append(
            goal(
                "bf16 loss vs fp32",
                s["bf16_vs_fp32_max_rel_loss"],
                "<= 2e-2 relative",
                s["bf16_vs_fp32_max_rel_loss"] <= 2e-2,
            )
        )
    if r := figures.get("race_probe"):
        md.append(
            f"- race probe (side-stream entries {r['side_stream_entries']}, {r['sleep_cycles']} cycles each): "
            f"delayed == undelayed bitwise {fmt(r['delayed_bitwise_undelayed'])}; vs plain bitwise "
            f"{fmt(r['bitwise_vs_plain'])}, max relative {r['max_rel_diff_vs_plain']:.2e}"
        )
        goals.append(
            goal(
                "race probe: delayed == undelayed", r["delayed_max_rel_diff"], "bitwise", r["delayed_bitwise_undelayed"]
            )
        )
        goals.append(
            goal(
                "race probe: vs plain",
                r["max_rel_diff_vs_plain"],
                "<= 1e-6 relative",
                r["max_rel_diff_vs_plain"] <= 1e-6,
            )
        )
        entries = r["side_stream_entries"]
        # on the CPU the offloaded shards are on the compute device already: no gather or reduce to delay
        sides = ("gather", "reduce", "offload") if env.cuda else ("offload",)
        every = all(entries.get(k, 0) > 0 for k in sides)
        goals.append(goal(f"race probe: {', '.join(sides)} streams delayed", str(entries), "each > 0", every))
    if h := figures.get("host_syncs"):
        n = h.get("sync_debug_warnings", h["python_reads"])
        md.append(f"- host syncs in one steady step: {h}")
        goals.append(goal("host syncs per step", n, "<= 1", n <= 1))
    if z := figures.get("sanitizer"):
        ok = z["returncode"] == 0 and z["races_reported"] == 0
        md.append(
            f"- TORCH_CUDA_SANITIZER={int(z['sanitizer'])} run: exit {z['returncode']}, races {z['races_reported']}"
        )
        goals.append(goal("sanitizer run", z["races_reported"], "exit 0, no race reported", ok))
    for name, tb in errors.items():
        md += ["", f"{name} failed:", "", "```", tb.rstrip(), "```"]
    return {"figures": figures, "goals": goals, "markdown": md}
