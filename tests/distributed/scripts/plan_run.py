"""One rank of the planner / CaSync / switch checks (launched torchrun-style by the tests).

Usage: plan_run.py OUT SCENARIO[,SCENARIO...]
    (plan_fixed | plan_measured | plan_replan | casync | fused_rounds | switch | switch_external)

Each scenario computes its reference independently from the dense inputs gathered here
with plain ``torch.distributed`` and writes the comparison to OUT/rank{r}.json.
"""

import json
import math
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from easgd_lightning.comm.meter import get_meter
from easgd_lightning.hooks import build_compressor, register_compression_hook
from easgd_lightning.hooks._exchange import exchange_tensors, pipelined_exchange, split_partitions
from easgd_lightning.hooks.collective import ProcessGroupCollective
from easgd_lightning.hooks.memory import ResidualMemory
from easgd_lightning.hooks.planner import Decision, Plan
from tests.helpers import run_rank_scenarios

RATIO = 0.05


class Net(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(20, 256).to(dtype)  # 5120
        self.fc2 = nn.Linear(256, 256).to(dtype)  # 65536
        self.fc3 = nn.Linear(256, 10).to(dtype)  # 2560

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _topk_dense(t: torch.Tensor, k: int) -> torch.Tensor:
    flat = t.reshape(-1)
    idx = flat.abs().topk(k).indices
    out = torch.zeros_like(flat)
    out[idx] = flat[idx]
    return out.view_as(t)


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _ddp_against_plan(rank: int, world: int, out_dir: str, *, fixed: bool, replan_steps: int = 0,
                      steps: int = 4) -> dict:
    """DDP with topk (exact) under a plan; every step's averaged gradients against the
    decision-by-decision reference: dense ones = dense all-reduce mean (bits), compressed
    ones = the codec's result per partition (top-k of the compensated partition, residual
    kept), gathered and averaged in rank order (bits). Per step: the iteration the active
    plan was made at, the replans so far and (rank 0) plan.json's ``iteration`` and
    ``replans`` as written."""
    comp = build_compressor("topk", ratio=RATIO, exact=True, min_numel=1000, plan="secopa",
                            replan_steps=replan_steps)
    model = Net()
    ddp = DistributedDataParallel(model)
    state = register_compression_hook(ddp, comp, warmup_steps=1, plan_dir=out_dir)
    if fixed:  # the decisions given outright: dense, compressed whole, compressed in 4
        want = {"fc1.weight": (True, 1), "fc2.weight": (True, 4), "fc3.weight": (False, 1)}
        decisions = {
            name: Decision(name, p.numel(), *want.get(name, (False, 1)), 0.0, None)
            for name, p in model.named_parameters()
        }
        state.active_plan, state.planned_at = Plan(decisions), 1
    ref_model = Net()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    residual = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    worst = {"dense": 0.0, "compressed": 0.0}
    history, plans = [], []
    for it in range(steps):
        g = torch.Generator().manual_seed(10 * rank + it)
        x, y = torch.randn(16, 20, generator=g), torch.randint(0, 10, (16,), generator=g)
        ref_model.load_state_dict(model.state_dict())
        ref_model.zero_grad()
        nn.functional.cross_entropy(ref_model(x), y).backward()
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        plan = state.active_plan
        for (name, p), (_, q) in zip(ref_model.named_parameters(), model.named_parameters()):
            d = plan.get(name) if it >= 1 else None
            if d is None or not d.compress:
                summed = p.grad.clone()
                dist.all_reduce(summed)
                expected, kind = summed / world, "dense"
            else:
                comp_in = p.grad + residual[name]
                contrib = torch.cat(
                    [_topk_dense(part, math.ceil(RATIO * part.numel())) for part in split_partitions(comp_in, d.partitions)]
                ).view_as(comp_in)
                residual[name] = comp_in - contrib
                total = torch.zeros_like(contrib)
                for c in _gather(contrib):
                    total += c
                expected, kind = total / world, "compressed"
            worst[kind] = max(worst[kind], (q.grad - expected).abs().max().item())
        opt.step()
        logged = os.path.join(out_dir, "plan.json")
        written = None
        if rank == 0 and os.path.exists(logged):  # rank 0 writes it, synchronously
            with open(logged) as fh:
                doc = json.load(fh)
            written = [doc["iteration"], doc["replans"]]
        history.append({"planned_at": state.planned_at, "replans": state.replans, "written": written})
        if plan is not None and (not plans or plans[-1][0] != plan.iteration):
            plans.append([plan.iteration, {k: [d.compress, d.partitions] for k, d in plan.decisions.items()}])
    plan = state.active_plan
    return {
        "worst": worst,
        "decisions": {k: [d.compress, d.partitions] for k, d in plan.decisions.items()},
        "stats": state.compression_stats(),
        "history": history,
        "plans": plans,
    }


def scenario_plan_fixed(rank, world, out_dir):
    return _ddp_against_plan(rank, world, out_dir, fixed=True)


def scenario_plan_measured(rank, world, out_dir):
    return _ddp_against_plan(rank, world, out_dir, fixed=False)


def scenario_plan_replan(rank, world, out_dir):
    """``replan_steps=2`` over 6 iterations (the first dense, hook warm-up): plans at
    iterations 1, 3 and 5, each followed decision by decision and logged to plan.json."""
    return _ddp_against_plan(rank, world, out_dir, fixed=False, replan_steps=2, steps=6)


def scenario_casync(rank: int, world: int, out_dir: str) -> dict:
    """Pipelined partitions against the partitions exchanged one by one, blocking (bits),
    for an all-gather codec (topk), all-reduce ones (fp16; PowerSGD's two rounds), and
    through start_exchange_tensors with a plan (residual conserved)."""
    coll = ProcessGroupCollective(None, kind="test")
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(96, 64, generator=g)
    out = {}
    for name, params, parts in (
        ("topk", {"ratio": 0.05, "exact": True}, 4),
        ("fp16", {}, 4),
        ("powersgd", {"rank": 2}, 3),
    ):
        comp = build_compressor(name, min_numel=0, **params)
        pieces = split_partitions(x.clone(), parts)
        piped = pipelined_exchange(comp, pieces, [{"key_hash": j} for j in range(len(pieces))], coll)
        # PowerSGD's reference is its batched two-all-reduce path (not the generator)
        alone = [
            comp.aggregate_many([p], [st], coll)[0] if name == "powersgd" else comp.aggregate(p, st, coll)
            for p, st in ((p.clone(), {"key_hash": j}) for j, p in enumerate(split_partitions(x.clone(), parts)))
        ]
        diff = max(
            max((a[0] - b[0]).abs().max().item(), (a[1] - b[1]).abs().max().item()) for a, b in zip(piped, alone)
        )
        rec = {"diff_vs_alone": diff}
        if name == "fp16":  # element-wise: partitioned = unpartitioned whole
            whole, _ = comp.aggregate(x.clone(), {}, coll)
            rec["diff_vs_whole"] = (torch.cat([m for m, _ in piped]) - whole).abs().max().item()
        out[name] = rec
    # through the exchange with a plan: memory conserves mass, mean = the pipeline's
    comp = build_compressor("topk", ratio=0.05, exact=True, min_numel=0)
    mem = ResidualMemory()
    small = torch.randn(100, generator=g)
    plan = Plan({"w": Decision("w", x.numel(), True, 4, 0.0, None), "b": Decision("b", 100, False, 1, 0.0, None)})
    locals_out: list = []
    means, _ = exchange_tensors([x, small], ["w", "b"], comp, mem, {}, coll, plan=plan, locals_out=locals_out)
    ref = pipelined_exchange(comp, split_partitions(x.clone(), 4), [{"key_hash": j} for j in range(4)], coll)
    out["exchange_plan"] = {
        "mean_diff": (means[0] - torch.cat([m for m, _ in ref])).abs().max().item(),
        "mass": (locals_out[0] + mem.residual("w") - x).abs().max().item(),
        "dense_diff": (means[1] - torch.stack(_gather(small)).sum(0) / world).abs().max().item(),
    }
    return out


def scenario_fused_rounds(rank: int, world: int, out_dir: str) -> dict:
    """The lazy all-reduce for multi-round codecs (PowerSGD: P then Q; fp16; csc: chunk
    scores then the chosen chunks, float64; sketch: bitmap OR then sketch sum): two exchanges of several tensors (small ones
    dense) with one fusion buffer and without, against each tensor exchanged alone by the
    codec's own ``aggregate`` (residual kept here; the small ones one dense all-reduce);
    csc also against a plain-torch model of GradientFlow's rule (:func:`_csc_reference`).
    Bits, and the messages of each exchange (the meter's calls). With 2 ranks every sum
    is a + b in any grouping (bits)."""
    from easgd_lightning.comm.layout import CommLayout
    from easgd_lightning.comm.meter import reset_meter
    from easgd_lightning.hooks._exchange import key_hash
    from easgd_lightning.hooks.elastic import exchange_sum

    shapes = [(48, 16), (7,), (32, 24), (5, 3), (40, 20), (9,)]  # 3 compressed, 3 dense (< 64)
    keys = [f"t{j}" for j in range(len(shapes))]
    out = {}
    codecs = (
        ("powersgd", {"rank": 2}, torch.float32),
        ("fp16", {"memory": True}, torch.float32),
        ("csc", {"ratio": 0.25, "chunk_size": 20}, torch.float64),  # 768 = 38 x 20 + 8: a short last chunk
        ("sketch", {"ratio": 0.05}, torch.float32),  # bitmap OR, then the sketch sum
    )
    for name, params, dtype in codecs:
        res: dict = {}
        independent = 0.0
        for mode, fusion in (("unfused", None), ("fused", 1 << 30)):
            comp = build_compressor(name, min_numel=64, **params)
            ref_comp = build_compressor(name, min_numel=64, **params)
            coll = ProcessGroupCollective(None, kind=f"{name}_{mode}", fusion_bytes=fusion)
            ref_coll = ProcessGroupCollective(None, kind="ref")
            mem, states = ResidualMemory(), {}
            residual = {k: 0.0 for k in keys}
            ref_states = {k: {"key_hash": key_hash(k)} for k in keys}
            worst, messages = 0.0, []
            for step in range(2):
                g = torch.Generator().manual_seed(1000 * rank + step)
                xs = [torch.randn(s, generator=g, dtype=dtype) for s in shapes]
                reset_meter()
                means, _ = exchange_tensors([x.clone() for x in xs], keys, comp, mem, states, coll)
                messages.append(get_meter().by_kind[f"{name}_{mode}"].calls)
                for k, x, m in zip(keys, xs, means):
                    if x.numel() < 64:
                        summed = x.clone()
                        dist.all_reduce(summed)
                        expected = summed / world
                    else:
                        comp_in = x + residual[k]
                        expected, local = ref_comp.aggregate(comp_in, ref_states[k], ref_coll)
                        residual[k] = comp_in - local
                        if name == "csc":
                            ref = _csc_reference(comp_in, params["ratio"], params["chunk_size"], world)
                            independent = max(independent, (m - ref).abs().max().item())
                    assert m.dtype == dtype
                    worst = max(worst, (m - expected).abs().max().item())
            res[mode] = {"worst": worst, "messages": messages, "independent": independent}
        out[name] = res
    # the elastic exchange (sync_easgd / local_sgd) with return_local: the multi-round
    # codec's local part arrives at wait(); sum = world x the exchange's means
    comp = build_compressor("powersgd", rank=2, min_numel=64)
    g = torch.Generator().manual_seed(7 + rank)
    diff = torch.randn(sum(math.prod(s) for s in shapes), generator=g)
    reset_meter()
    total, local = exchange_sum(
        diff.clone(), compressor=comp, state={}, kind="e", shapes=shapes, layout=CommLayout(fusion_mb=25), return_local=True
    )
    out["elastic"] = {"messages": get_meter().by_kind["e"].calls, "local_shape": list(local.shape)}
    comp = build_compressor("csc", ratio=0.25, chunk_size=20, min_numel=64)
    reset_meter()
    exchange_sum(diff.clone(), compressor=comp, state={}, kind="e_csc", shapes=shapes, layout=CommLayout(fusion_mb=25))
    out["elastic_csc"] = {"messages": get_meter().by_kind["e_csc"].calls}
    return out


def _csc_reference(x: torch.Tensor, ratio: float, chunk: int, world: int) -> torch.Tensor:
    """GradientFlow's coarse-grained sparse all-reduce of ``x`` in plain torch: chunk L1
    norms summed over ranks, the top ceil(ratio * chunks) (ties to the lower index) kept
    by a 0/1 mask, the masked tensor all-reduced densely and divided by the world."""
    flat = x.reshape(-1)
    n = flat.numel()
    chunks = -(-n // chunk)
    full = n // chunk
    scores = torch.empty(chunks, dtype=flat.dtype)
    scores[:full] = flat[: full * chunk].view(full, chunk).abs().sum(dim=1)
    if full < chunks:
        scores[full] = flat[full * chunk :].abs().sum()
    dist.all_reduce(scores)
    k = max(1, math.ceil(ratio * chunks))
    top = torch.argsort(-scores, stable=True)[:k]
    keep = torch.zeros(chunks, dtype=torch.bool)
    keep[top] = True
    mask = keep.repeat_interleave(chunk)[:n]
    summed = torch.where(mask, flat, torch.zeros_like(flat))
    dist.all_reduce(summed)
    return (summed / world).view(x.shape)


def _switch_checks(rank: int, world: int, aggregator: str) -> dict:
    """A float64 DDP run with the switch hook against the ring hook (same data, bits);
    then sums through the hook's switch against dist.all_reduce (exact values), several
    in flight at once, and the bytes metered (each tensor once, plus its header)."""
    grads, clients = {}, []
    for mode in ("ring", "switch"):
        model = Net(torch.float64)
        ddp = DistributedDataParallel(model)
        state = register_compression_hook(ddp, None, allreduce=mode, aggregator=aggregator, timeout_s=60)
        clients.append(state.switch)
        for it in range(3):
            gen = torch.Generator().manual_seed(10 * rank + it)
            x = torch.randn(8, 20, generator=gen, dtype=torch.float64)
            ddp.zero_grad()
            ddp(x).square().mean().backward()
        grads[mode] = [p.grad.clone() for p in model.parameters()]
    ddp_equal = all(torch.equal(a, b) for a, b in zip(grads["ring"], grads["switch"]))
    client = clients[1]
    g = torch.Generator().manual_seed(rank)
    tensors = [torch.randint(-1000, 1000, (n,), generator=g).double() / 8 for n in (1, 1000, 250_003)]  # the last: 8 streamed blocks, a short last one
    futs = [client.all_reduce_async(t.clone(), kind="switch_test") for t in tensors]
    got = [f.wait()[0] for f in futs]
    ref = []
    for t in tensors:
        r = t.clone()
        dist.all_reduce(r)
        ref.append(r)
    equal = [bool(torch.equal(a, b)) for a, b in zip(got, ref)]
    sent = get_meter().by_kind["switch_test"].bytes_sent
    client.close()
    return {"equal": equal, "sent": sent, "expected_sent": sum(t.numel() * 8 + 24 for t in tensors), "ddp_equal": ddp_equal}


def scenario_switch(rank, world, out_dir):
    return _switch_checks(rank, world, "rank0")


def scenario_switch_external(rank, world, out_dir):
    return _switch_checks(rank, world, "external")


def main() -> None:
    run_rank_scenarios(lambda name, rank, world, out_dir: globals()[f"scenario_{name}"](rank, world, out_dir))


if __name__ == "__main__":
    main()
