"""tplab.memory's model against the CUDA caching allocator, in each rank (benchmarks/gpu.py
--memory runs this; the GPU path of issue 39, item 2).

Notebook 10's block (`models.Block`, dim 64, 8 heads, hidden 192, seq 32, batch 4) at TP 1,
2 and 4, with and without SP (under `plans.block(sp)`, and at TP 2 and 4 under
`megatron.parallelize` too), and notebook 13's checkpointed TinyLM at TP 4 (plain and with
every Block checkpointed, megatron.parallelize with and without SP), on a 4-rank gloo lab
whose ranks all use the one GPU (NCCL refuses two ranks on one device). The mesh is made
with device type "cuda" over gloo, so the parameters and activations are CUDA tensors.

For each case, on every rank, after one warm-up step (the plan's layout check, cuBLAS's
workspace and DTensor's caches are made then, and stay):

- predicted: `tplab.cost.lab_models.lab_memory` (notebook 10: params, saved activations,
  their peak) with `device="cpu"` and with `device="cuda"` (the fused RMSNorm, the
  memory-efficient attention's random-number state and padded logsumexp): each must equal
  tplab.memory's whole summary on that device, as notebook 10 asserts;
- tplab.memory on CPU and on CUDA: the distinct storages autograd saved, by nbytes;
- the allocator: `torch.cuda.memory_allocated()` before the step, after the forward (the
  loss alive, the output dropped), and `torch.cuda.max_memory_allocated()` over forward and
  backward (peak stats reset just before), each less the allocation before the step; and,
  from `torch.cuda.memory_snapshot()`, which blocks that the forward left allocated are
  the storages tplab.memory counted (their block sizes: 512-byte rounding) and which are
  something else.

Then probes of the collectives such a lab uses, on CUDA tensors over gloo (torch 2.11's
functional all-gather of CUDA tensors over gloo segfaults: pytorch/pytorch#152645, which is
why `plans.block(sp=True)` cannot run here and the Megatron plan's SP rows stand in), and
whether autograd runs backward on another thread than the caller's (on CUDA it does; the
first run here found tplab.memory's open contexts per thread, so it missed a checkpoint's
recomputation on CUDA: they are the process's now, and the checkpointed rows must show it).

Nothing here changes a number to make it agree: the difference is printed, in bytes. A
summary row is FAIL when the ranks disagree, when tplab.memory differs from `lab_memory`
for the device (the lab's promise, on CPU and on CUDA), or when a checkpointed model shows
no recomputation; else PASS for the block (the promise held) and INFO for the TinyLM.
"""

from __future__ import annotations

import traceback

BLOCK_CFG = dict(dim=64, n_heads=8, hidden_dim=192, seq_len=32, batch_size=4)   # notebook 10
LM_CFG = dict(vocab_size=32, dim=16, n_layers=2, n_heads=4, hidden_dim=32, seq_len=8,
              batch_size=4)                                                  # notebook 13
WORLD = 4


def _blocks() -> dict[int, int]:
    """{address: block size} of every allocated block of this process's CUDA allocator."""
    import torch

    out = {}
    for seg in torch.cuda.memory_snapshot():
        addr = seg["address"]
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                out[b.get("address", addr)] = b["size"]
            addr += b["size"]
    return out


def rank_case(case: str, tp: int, sp: bool, device: str) -> dict:
    """On a rank: one case ("block": notebook 10's Block under plans.block(sp) on a dp x tp
    mesh; "plain"/"checkpointed": notebook 13's TinyLM under megatron.parallelize on a tp
    mesh of the whole world) on `device`; tplab.memory's numbers and, on CUDA, the
    allocator's (module doc)."""
    import functools
    import gc

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import tplab
    from tplab import checkpointing, megatron, models, plans

    cuda = device == "cuda"

    def allocated() -> int:
        if not cuda:
            return 0
        torch.cuda.synchronize()
        gc.collect()
        return torch.cuda.memory_allocated()

    world = dist.get_world_size()
    torch.manual_seed(0)
    out: dict = {"case": case, "tp": tp, "sp": sp, "device": device,
                 "rank": dist.get_rank()}
    start = allocated()
    if case in ("block", "block megatron"):
        cfg = models.Config(**BLOCK_CFG)
        mesh = init_device_mesh(device, (world // tp, tp), mesh_dim_names=("dp", "tp"))
        block = models.Block(cfg).to(device)
        model = (tplab.apply_plan(block, mesh, plans.block(sp)) if case == "block" else
                 megatron.parallelize(block, mesh, sequence_parallel=sp))
        x = models.make_input(cfg).to(device).requires_grad_()
    else:
        cfg = models.Config(**LM_CFG)
        mesh = init_device_mesh(device, (world,), mesh_dim_names=("tp",))
        model = functools.partial(megatron.parallelize, sequence_parallel=sp)(
            models.TinyLM(cfg).to(device), mesh)
        if case == "checkpointed":
            checkpointing.checkpoint_blocks(model, ("Block",))
        x = models.make_tokens(cfg).to(device)

    def loss_of(y, tokens=x):
        return models.lm_loss(y, tokens) if case in ("plain", "checkpointed") else y.sum()
    placed = allocated()
    out["param_alloc"] = placed - start     # parameters and the input, as the allocator holds
    out["param_storage_bytes"] = sum(p.to_local().untyped_storage().nbytes()
                                     if hasattr(p, "to_local") else
                                     p.untyped_storage().nbytes() for p in model.parameters())
    loss_of(model(x)).backward()            # warm-up (module doc)
    model.zero_grad(set_to_none=True)
    x.grad = None
    before = allocated()
    out["warmup_kept"] = before - placed    # what the first step left allocated
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        blocks_before = _blocks()
    with tplab.memory() as m:
        loss = loss_of(model(x))
        if cuda:
            after_forward = allocated()
            out["forward_peak"] = torch.cuda.max_memory_allocated() - before
            blocks = _blocks()
            saved = {ptr for (_, ptr) in m._live}       # the storages counted alive now
            new = {a: s for a, s in blocks.items() if a not in blocks_before}
            out["forward_alloc"] = after_forward - before
            out["saved_new_blocks"] = sum(s for a, s in new.items() if a in saved)
            out["saved_resident_blocks"] = sum(s for a, s in blocks_before.items()
                                               if a in saved)
            out["other_new_blocks"] = sorted((s for a, s in new.items() if a not in saved),
                                             reverse=True)
            out["saved_storage_nbytes"] = sum(n for n, _ in m._live.values())
        loss.backward()
        del loss
    if cuda:
        torch.cuda.synchronize()
        out["peak_alloc"] = torch.cuda.max_memory_allocated() - before
        out["after_step_alloc"] = allocated() - before    # the gradients
    s = m.summary()
    for key in ("param_bytes", "grad_bytes", "activation_bytes", "peak_bytes",
                "recomputed_bytes"):
        out[key] = s[key]
    out["rows"] = {r["module"]: r["bytes"] for r in s["rows"]}
    out["summary"] = s
    return out


def rank_collective(op: str) -> str:
    """On a rank: one collective of CUDA tensors over the lab's (gloo) group, checked."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    n, r = dist.get_world_size(), dist.get_rank()
    x = torch.full((n * 4,), float(r + 1), device="cuda")
    if op == "all_gather_into_tensor":
        out = torch.empty(n * x.numel(), device="cuda")
        dist.all_gather_into_tensor(out, x)
        ok = out.view(n, -1)[:, 0].tolist() == [float(i + 1) for i in range(n)]
    elif op == "reduce_scatter_tensor":
        out = torch.empty(4, device="cuda")
        dist.reduce_scatter_tensor(out, x)
        ok = out.tolist() == [float(n * (n + 1) // 2)] * 4
    elif op == "funcol.all_gather_tensor":
        out = funcol.all_gather_tensor(x, 0, dist.group.WORLD).wait()
        ok = out.view(n, -1)[:, 0].tolist() == [float(i + 1) for i in range(n)]
    elif op == "funcol.reduce_scatter_tensor":
        out = funcol.reduce_scatter_tensor(x, "sum", 0, dist.group.WORLD).wait()
        ok = out.tolist() == [float(n * (n + 1) // 2)] * 4
    else:   # a DTensor on a "cuda" mesh over gloo: Shard(0) -> Replicate (an all-gather)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cuda", (n,), mesh_dim_names=("tp",))
        whole = torch.arange(n * 4.0, device="cuda")
        got = distribute_tensor(whole, mesh, [Shard(0)]).redistribute(mesh, [Replicate()])
        ok = torch.equal(got.to_local(), whole)
    torch.cuda.synchronize()
    return "right" if ok else "WRONG"


def backward_thread(device: str) -> bool:
    """Does autograd run this device's backward on another thread than the caller's?"""
    import threading

    import torch

    x = torch.ones(4, device=device, requires_grad=True)
    seen: list[int] = []
    x.register_hook(lambda g: seen.append(threading.get_ident()))
    (x * 2).sum().backward()
    return seen[0] != threading.get_ident()


PROBES = ("all_gather_into_tensor", "reduce_scatter_tensor", "funcol.all_gather_tensor",
          "funcol.reduce_scatter_tensor", "DTensor Shard(0) -> Replicate")


def _fused_prediction(tp: int, sp: bool) -> int:
    """Notebook 10's block's saved bytes with the fused RMSNorm (input and rstd kept:
    `tplab_layer(norm="fused")`), as `lab_memory` sums them."""
    from tplab import models
    from tplab.cost.lab_models import lab_shape
    from tplab.cost.memory import tplab_layer

    shape = lab_shape(models.Config(**BLOCK_CFG))
    return int(sum(i.local_bytes(shape.tokens, tp, sp)
                   for i in tplab_layer(shape, norm="fused")))


def run(results: dict) -> list[tuple[str, str, str]]:
    """Every case on a 4-rank gloo lab of CUDA tensors; fills results["memory"] and returns
    summary rows (name, status, detail). Each case is independent: a failure is a FAIL row
    with its reason, and the next case runs."""
    import tplab
    from tplab import models
    from tplab.cost.lab_models import lab_memory

    rows: list[tuple[str, str, str]] = []
    out = results.setdefault("memory", {"cases": [], "errors": []})
    # plans.block(sp=True) all-gathers through DTensor's functional collectives, which crash
    # on CUDA tensors over gloo (module doc; seen here, SIGSEGV): its SP rows are left out
    cases = [("block", tp, False) for tp in (1, 2, 4)]
    # the same block under the hand-written Megatron plan, which saves the same tensors
    # (lab_memory's doc) and reaches SP through plain c10d collectives, not DTensor's
    cases += [("block megatron", tp, sp) for tp in (2, 4) for sp in (False, True)]
    cases += [("plain", WORLD, sp) for sp in (False, True)]
    cases += [("checkpointed", WORLD, sp) for sp in (False, True)]
    out["backward_on_another_thread"] = {d: backward_thread(d) for d in ("cpu", "cuda")}
    print(f"[INFO] autograd's backward runs on another thread than the caller's: "
          f"{out['backward_on_another_thread']} (tplab.memory counts there too: its open "
          "contexts are the process's)",
          flush=True)
    try:
        lab = tplab.launch(WORLD, backend="gloo", timeout=30)   # a hang: 30 s, not 60
    except Exception as exc:  # noqa: BLE001 - reported, the other sections go on
        out["errors"].append(f"launch: {type(exc).__name__}: {exc}")
        print(f"[FAIL] memory: a {WORLD}-rank gloo lab did not start: {exc}", flush=True)
        return [("memory: lab", "FAIL", str(exc)[:200])]
    with lab:
        for case, tp, sp in cases:
            name = f"memory {case} TP {tp}{' + SP' if sp else ''}"
            device = "cpu"
            try:
                cpu = lab.run(rank_case, case, tp, sp, device)
                device = "cuda"
                gpu = lab.run(rank_case, case, tp, sp, device)
            except Exception as exc:  # noqa: BLE001
                why = (f"on {device}: {type(exc).__name__}: "
                       f"{_first_line(exc)}")
                out["errors"].append({"case": name, "error": why,
                                      "traceback": traceback.format_exc(limit=-4)})
                print(f"[FAIL] {name}: {why}", flush=True)
                rows.append((name, "FAIL", why))
                continue
            entry = {"case": case, "tp": tp, "sp": sp, "cpu": cpu, "cuda": gpu}
            if case.startswith("block"):
                pred = lab_memory("block", models.Config(**BLOCK_CFG), tp, sp)
                entry["predicted"] = {k: pred[k] for k in ("param_bytes", "activation_bytes",
                                                          "peak_bytes")}
                entry["predicted_fused_norm"] = _fused_prediction(tp, sp)
                on = {d: lab_memory("block", models.Config(**BLOCK_CFG), tp, sp, device=d)
                      for d in ("cpu", "cuda")}
                entry["equal"] = {d: all(r["summary"] == on[d] for r in ranks)
                                  for d, ranks in (("cpu", cpu), ("cuda", gpu))}
                entry["predicted_cuda"] = on["cuda"]
            out["cases"].append(entry)
            rows.append(_report(name, entry))
        out["collectives"] = {}
        for op in PROBES:   # last: a crash restarts the lab, and nothing else runs after
            try:
                got = lab.run(rank_collective, op)
                status = "PASS" if set(got) == {"right"} else "FAIL"
                detail = f"CUDA tensors over gloo, {WORLD} ranks on one GPU: {got}"
            except Exception as exc:  # noqa: BLE001
                status, detail = "FAIL", f"{type(exc).__name__}: {_first_line(exc)}"
            out["collectives"][op] = {"status": status, "detail": detail}
            print(f"[{status}] gloo {op} of CUDA tensors: {detail}", flush=True)
            rows.append((f"gloo + CUDA: {op}", status, detail))
    return rows


def _first_line(exc: Exception) -> str:
    """The line of a lab's error that says what happened (a crash's signal, if any)."""
    lines = [x for x in str(exc).strip().splitlines() if x.strip()]
    crash = next((x for x in lines if "crashed with" in x or "Error:" in x), None)
    return (crash or (lines[-1] if lines else repr(exc)))[:300]


def _report(name: str, e: dict) -> tuple[str, str, str]:
    """Print one case's numbers (rank 0, and whether every rank agrees); a summary row."""
    c0, g0 = e["cpu"][0], e["cuda"][0]
    keys = ("activation_bytes", "peak_bytes", "forward_alloc", "peak_alloc")
    same = all(all(r.get(k) == g0.get(k) for k in keys) for r in e["cuda"])
    pred = e.get("predicted")
    lines = [f"  ranks agree on every number: {same}"]
    if pred:
        lines.append(f"  params: predicted {pred['param_bytes']} B, storages on CUDA "
                     f"{g0['param_storage_bytes']} B, allocator (params + input) "
                     f"{g0['param_alloc']} B")
        lines.append(f"  saved activations: predicted {pred['activation_bytes']} (fused "
                     f"RMSNorm {e['predicted_fused_norm']}), tplab.memory CPU "
                     f"{c0['activation_bytes']}, CUDA {g0['activation_bytes']} "
                     f"(CUDA - predicted {g0['activation_bytes'] - pred['activation_bytes']:+d})")
        ref = pred["peak_bytes"]
        what = "predicted peak (lab_memory)"
    else:
        lines.append(f"  saved: tplab.memory CPU activation {c0['activation_bytes']} peak "
                     f"{c0['peak_bytes']} recomputed {c0['recomputed_bytes']}; CUDA "
                     f"activation {g0['activation_bytes']} peak {g0['peak_bytes']} "
                     f"recomputed {g0['recomputed_bytes']}")
        ref = c0["peak_bytes"]
        what = "tplab.memory peak on CPU"
    lines.append(f"  allocator after the forward: {g0['forward_alloc']} B = saved storages "
                 f"new in it {g0['saved_new_blocks']} (their nbytes "
                 f"{g0['saved_storage_nbytes']}, {g0['saved_resident_blocks']} B of saved "
                 f"storages were already resident) + other blocks "
                 f"{sum(g0['other_new_blocks'])} B {g0['other_new_blocks'][:8]}")
    diff = g0["peak_alloc"] - ref
    lines.append(f"  max_memory_allocated over the forward - before: {g0['forward_peak']} B")
    lines.append(f"  max_memory_allocated over the step - before: {g0['peak_alloc']} B; "
                 f"{what} {ref} B; difference {diff:+d} B; after the step (grads) "
                 f"{g0['after_step_alloc']} B; first step left {g0['warmup_kept']} B")
    # FAIL: the ranks disagree, tplab.memory differs from lab_memory on either device (the
    # lab's promise), or a checkpointed model shows no recomputation; the allocator's
    # numbers are reported, not judged (docs/VALIDATION.md explains them)
    if pred:
        lines.append(f"  tplab.memory == lab_memory(device=...): {e['equal']}")
        status = "PASS" if same and all(e["equal"].values()) else "FAIL"
        held = f"; equal to lab_memory: {e['equal']}"
    else:
        again = g0["recomputed_bytes"] > 0 if e["case"] == "checkpointed" else True
        status = "INFO" if same and again else "FAIL"
        held = f"; recomputed CUDA {g0['recomputed_bytes']} CPU {c0['recomputed_bytes']}"
    print(f"[{status}] {name}\n" + "\n".join(lines), flush=True)
    return name, status, (f"peak alloc {g0['peak_alloc']} vs {what} {ref}: {diff:+d} B; "
                          f"saved CUDA {g0['activation_bytes']} CPU {c0['activation_bytes']}"
                          + held)
