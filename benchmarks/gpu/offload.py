"""Part e: offload.

1. Copy bandwidth between the device and host memory, both ways, pinned and pageable: 1 GiB,
   median of 5 copies after one (device events). Smoke: host-to-host clones of 8 MiB.
2. BERT-large MLM (seq 512, batch 16, fp32, AdamW): none, memfit full, memfit offload="cpu"
   (every layer's input to pinned host memory, recomputed in backward) and
   ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around a plain model's forward: median
   step time, max_memory_allocated, the bytes memfit moved each way (memfit.testing.offload_stats)
   and the link's share of the step (bytes / measured pinned bandwidth / step time; save_on_cpu:
   the kept activation bytes of none, each way). Smoke: host offload of CPU tensors on the
   accelerator path, save_on_cpu unpinned.
"""

from __future__ import annotations

import contextlib
import copy

import torch

import memfit
from benchmarks.gpu._env import GIB, MIB, Env, fmt, mib, ratio
from benchmarks.gpu.bert import SMOKE
from memfit.models import Shape, bert_layer_class, bert_mlm, mlm_batch


def bandwidth(env: Env) -> dict:
    n = 8 * MIB if env.smoke else GIB
    out = {}
    if not env.cuda:
        src = torch.empty(n, dtype=torch.uint8).fill_(1)
        t = env.median_time(src.clone, 1, 3)
        return {"host_to_host_GBps": n / t / 1e9}
    dev = torch.empty(n, dtype=torch.uint8, device=env.device).fill_(1)
    for pinned in (True, False):
        host = torch.empty(n, dtype=torch.uint8, pin_memory=pinned).fill_(1)
        kind = "pinned" if pinned else "pageable"
        h2d = env.median_time(lambda h=host: dev.copy_(h, non_blocking=True), 1, 5)
        d2h = env.median_time(lambda h=host: h.copy_(dev, non_blocking=True), 1, 5)
        out[f"h2d_{kind}_GBps"] = n / h2d / 1e9
        out[f"d2h_{kind}_GBps"] = n / d2h / 1e9
    return out


def strategies(env: Env, shape: Shape, bw: dict) -> dict:
    from memfit.testing import host_offload_on_cpu, offload_stats

    base = bert_mlm(shape)
    batch = {k: v.to(env.device) for k, v in mlm_batch(shape).items()}
    rows = {}
    for name in ("none", "memfit full", "memfit offload cpu", "save_on_cpu(pin_memory=True)"):
        env.log(f"  e: {name}")
        try:
            with host_offload_on_cpu() if (name == "memfit offload cpu" and not env.cuda) else contextlib.nullcontext():
                model = copy.deepcopy(base).to(env.device).train()
                if name == "memfit full":
                    memfit.Decision("full").apply_to(model, bert_layer_class())
                elif name == "memfit offload cpu":
                    memfit.Decision("offload", offload="cpu").apply_to(model, bert_layer_class())
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
                kept = [0]
                saving = (
                    (lambda: torch.autograd.graph.save_on_cpu(pin_memory=env.cuda))
                    if name.startswith("save_on_cpu")
                    else contextlib.nullcontext
                )

                def step(model=model, opt=opt, saving=saving, kept=kept):
                    before = env.allocated()
                    with saving():
                        loss = model(**batch).loss
                    kept[0] = env.allocated() - before
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)

                warmup, repeats = (0, 1) if env.smoke else (2, 5)
                seconds = env.median_time(step, warmup, repeats)
                offload_stats().reset()
                peaks = env.allocator_peaks(step)
                stats = offload_stats()
                rows[name] = {
                    "step_s": seconds,
                    **peaks,
                    "kept_after_forward": kept[0],
                    "d2h_bytes": stats.d2h_bytes,
                    "h2d_bytes": stats.h2d_bytes,
                }
                if env.smoke:
                    with memfit.MemoryMeter(model=model, optimizer=opt) as meter:
                        step()
                    rows[name]["meter_peak"] = meter.peak_bytes
        except Exception as e:  # recorded; the others still run
            rows[name] = {"error": f"{type(e).__name__}: {e}"}
        env.free()
    link = min(bw.get("h2d_pinned_GBps", 0), bw.get("d2h_pinned_GBps", 0)) * 1e9
    none_kept = rows.get("none", {}).get("kept_after_forward", 0)
    for name, r in rows.items():
        if "error" in r:
            continue
        moved = r["d2h_bytes"] + r["h2d_bytes"]
        if name.startswith("save_on_cpu"):
            moved = 2 * none_kept  # what none keeps goes out and comes back
        r["bytes_moved"] = moved
        r["link_share"] = moved / link / r["step_s"] if link else None
    return rows


def run(env: Env) -> dict:
    bw = bandwidth(env)
    shape = SMOKE if env.smoke else Shape(layers=24, hidden=1024, heads=16, seq=512, batch=16, vocab=30522)
    rows = strategies(env, shape, bw)
    md = ["Copy bandwidth (1 GiB, median of 5): " + ", ".join(f"{k} {v:.1f}" for k, v in bw.items()), ""]
    md += [
        f"BertForMaskedLM {shape}, fp32, AdamW; median of 5 steps after 2 warm-up.",
        "",
        "| strategy | step s | vs none | max allocated MiB | kept MiB | moved MiB | link share of step |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    none = rows.get("none", {})
    for name, r in rows.items():
        if "error" in r:
            md.append(f"| {name} | {r['error']} ||||||")
            continue
        md.append(
            f"| {name} | {r['step_s']:.3f} | {fmt(ratio(r['step_s'], none.get('step_s')))} | {mib(r['max_allocated'])} "
            f"| {mib(r['kept_after_forward'])} | {mib(r['bytes_moved'])} | {fmt(r['link_share'])} |"
        )
    errors = {n: r["error"] for n, r in rows.items() if "error" in r}
    # figures only: the issue sets no pass/fail goal for offload beyond running
    return {
        "figures": {"bandwidth": bw, "shape": str(shape), "results": rows, "errors": errors},
        "goals": [],
        "markdown": md,
    }
