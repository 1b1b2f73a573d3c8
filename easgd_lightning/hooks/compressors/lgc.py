"""``lgc``: learned gradient compression (Abrahamyan et al., LGC, TNNLS 2021).

Rule, per tensor and step t, p workers, k = ceil(ratio n):
  mask:   the leader (rank t mod p) sends the indices of its k largest |g| (error-compensated),
          ordered by decreasing magnitude, and its scale s = ||x_leader|| / sqrt(k) (one more
          int32 word, the float's bits); every worker takes x_i = g_i[mask] (length k), so the
          workers' vectors line up entry by entry;
  coder:  a small non-linear autoencoder shared by all ranks. x / s is cut into blocks of
          b = min(k, ``block``) entries (zero-padded); the encoder is the same two-layer
          network on every block (a 1-D convolution with kernel = stride = b, LeakyReLU, a
          1x1 convolution down to c_b = ceil(code_ratio b) channels), the decoder mirrors it
          (c_b -> hidden -> b). Code size c = blocks * c_b;
  phase 1 (the first ``coder_warmup_steps`` steps, and whenever the code is not good enough):
          top-k with the shared mask; the x_i / s are all-gathered (every rank sees every
          worker's vector) and kept as training data (the most recent ``MAX_GROUPS`` steps);
  train:  at the end of phase 1, Adam on  mean_t ||D(sum_i E(x_i)) - sum_i x_i||^2 / ||sum_i x_i||^2
          + mean_{t,i} ||D(E(x_i)) - x_i||^2 / ||x_i||^2  (the sum of the codes must decode to
          the sum of the inputs: the parameter-server and ring instances both decode summed
          codes), from a seed shared by all ranks; the weights are then averaged over ranks
          (one all-reduce), so every rank holds the same coder. The held-out error, the first
          term's relative error on the last fifth of the steps (never trained on), must be
          <= ``max_error``, else phase 1 goes on (the reason is logged) and training resumes
          ``coder_warmup_steps`` later with the new vectors;
  phase 2: worker i sends z_i = E(x_i / s) (c values). ``style: ring``: the codes are
          all-reduced and every rank decodes the sum, s D(sum_i z_i); ``style: ps``: the
          codes are all-gathered and the sum is decoded once, as the server would. Error
          feedback: e_i <- g_i - s D(z_i) scattered at the mask (``memory``). Each rank's
          relative error ||x_i - s D(z_i)|| / ||x_i|| rides with the codes (one value);
          when its running mean over ranks (EMA, 0.9) exceeds ``max_error`` the compressor
          falls back to phase 1 (logged) and retrains.
Defaults: ratio 0.01, code_ratio 0.25, coder_warmup_steps 50, max_error 0.8 (bench/
compression_digits.py, 20 epochs: codes in 48% of the exchanges, the rest shared-mask top-k;
error feedback carries what the code loses), hidden 64, block 256, train_iters 300, style
ring, memory true, min_numel 16384.
Fused exchange (:mod:`easgd_lightning.hooks._fused`, ``rounds_segments``): every tensor keeps
its own leader's mask, samples, coder and phase (the group's ``segment_states``); the masks
travel in one all-gather, the phase-1 tensors' values in one all-gather and the phase-2
tensors' codes in one all-reduce (``ps``: all-gather) per exchange; a coder's training
(its weights' all-reduce) stays per tensor, on the steps it happens.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from easgd_lightning.hooks.compressors.base import (
    Collective,
    Compressor,
    Payload,
    check_choice,
    check_int,
    check_positive,
    check_ratio,
    num_selected,
    scratch_buffer,
    scratch_of,
    start_collective,
    wants_local,
)
from easgd_lightning.hooks.compressors.segments import SEGMENT_STATES, Segments
from easgd_lightning.utils.renames import accepts_renamed

__all__ = ["LGCCompressor", "BlockAutoencoder", "train_autoencoder", "sum_decode_error"]

log = logging.getLogger(__name__)
STYLES = ("ring", "ps")
MAX_GROUPS = 200  # training steps kept per tensor (the most recent); each is p vectors
EMA = 0.9  # running mean of the phase-2 reconstruction error


class BlockAutoencoder(nn.Module):
    """Encoder k -> c and decoder c -> k, one two-layer network per block of b entries."""

    def __init__(self, k: int, code_ratio: float, hidden: int, block: int, seed: int) -> None:
        super().__init__()
        self.k = k
        self.b = min(k, block)
        self.blocks = math.ceil(k / self.b)
        self.cb = max(1, math.ceil(code_ratio * self.b - 1e-9))
        self.enc = nn.Sequential(nn.Linear(self.b, hidden), nn.LeakyReLU(0.1), nn.Linear(hidden, self.cb))
        self.dec = nn.Sequential(nn.Linear(self.cb, hidden), nn.LeakyReLU(0.1), nn.Linear(hidden, self.b))
        # the same initial weights on every rank: PyTorch's default uniform(+-1/sqrt(fan_in))
        # drawn from a generator of its own (the global one is left alone)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for layer in (*self.enc[::2], *self.dec[::2]):
                bound = 1 / math.sqrt(layer.in_features)
                for p in (layer.weight, layer.bias):
                    p.copy_(torch.rand(p.shape, generator=gen) * (2 * bound) - bound)

    @property
    def code_size(self) -> int:
        return self.blocks * self.cb

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """(..., k) -> (..., c)."""
        pad = self.blocks * self.b - self.k
        xb = torch.nn.functional.pad(x, (0, pad)).reshape(*x.shape[:-1], self.blocks, self.b)
        return self.enc(xb).reshape(*x.shape[:-1], self.code_size)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """(..., c) -> (..., k)."""
        zb = z.reshape(*z.shape[:-1], self.blocks, self.cb)
        return self.dec(zb).reshape(*z.shape[:-1], self.blocks * self.b)[..., : self.k]


def _rel_sq(err: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (err.pow(2).sum(-1) / ref.pow(2).sum(-1).clamp_min(1e-30)).mean()


def sum_decode_error(ae: BlockAutoencoder, groups: torch.Tensor) -> float:
    """||D(sum_i E(x_i)) - sum_i x_i|| / ||sum_i x_i|| over the groups (T x p x k), pooled."""
    with torch.no_grad():
        total = groups.sum(1)
        rebuilt = ae.decode(ae.encode(groups).sum(1))
        norm = float(torch.linalg.norm(total))
        return float(torch.linalg.norm(rebuilt - total)) / norm if norm > 0 else 0.0


def train_autoencoder(ae: BlockAutoencoder, groups: torch.Tensor, iters: int, lr: float = 3e-3) -> None:
    """Full-batch Adam on the sum and per-worker reconstruction losses (T x p x k groups)."""
    opt = torch.optim.Adam(ae.parameters(), lr=lr)
    total = groups.sum(1)
    with torch.enable_grad():  # the communication hooks run with autograd off
        _train_loop(ae, opt, groups, total, iters)


def _train_loop(ae: BlockAutoencoder, opt: torch.optim.Optimizer, groups: torch.Tensor, total: torch.Tensor, iters: int) -> None:
    for _ in range(iters):
        opt.zero_grad(set_to_none=True)
        z = ae.encode(groups)
        loss = _rel_sq(ae.decode(z.sum(1)) - total, total) + _rel_sq(ae.decode(z) - groups, groups)
        loss.backward()
        opt.step()


class LGCCompressor(Compressor):
    """LGC: shared top-k mask, a non-linear autoencoder trained in phase 1, codes in phase 2.

    Args:
        ratio: density k / n of the shared mask, in (0, 1].
        code_ratio: code size c / k, in (0, 1].
        coder_warmup_steps: phase-1 steps before (re)training the coder (>= 2; before 0.2:
            ``warmup_steps``, still accepted with a ``FutureWarning``).
        max_error: relative reconstruction error above which the code is not used (> 0).
        style: ``ring`` (codes all-reduced) or ``ps`` (codes all-gathered, summed, decoded).
        hidden: hidden width of the encoder and decoder networks (>= 1).
        block: block length b of the per-block networks (>= 1).
        train_iters: Adam iterations per training round (>= 1).
        min_numel, memory: attach-point policies (see :class:`Compressor`).
    """

    name = "lgc"
    aggregation = "allreduce"
    default_memory = True
    fused_segments = True  # in the multi-round form: rounds_segments
    segment_state = True  # each tensor's coder, samples and phase (the fused exchange's segment_states)

    @accepts_renamed("lgc", "compression")
    def __init__(
        self,
        ratio: float = 0.01,
        *,
        code_ratio: float = 0.25,
        coder_warmup_steps: int = 50,
        max_error: float = 0.8,
        style: str = "ring",
        hidden: int = 64,
        block: int = 256,
        train_iters: int = 300,
        min_numel: int | None = None,
        memory: bool | None = None,
    ) -> None:
        super().__init__(min_numel=min_numel, memory=memory)
        self.ratio = check_ratio("compression.ratio", ratio)
        self.code_ratio = check_ratio("compression.code_ratio", code_ratio)
        self.coder_warmup_steps = check_int("compression.coder_warmup_steps", coder_warmup_steps, 2)
        self.max_error = check_positive("compression.max_error", max_error)
        self.style = check_choice("compression.style", style, STYLES)
        self.hidden = check_int("compression.hidden", hidden, 1)
        self.block = check_int("compression.block", block, 1)
        self.train_iters = check_int("compression.train_iters", train_iters, 1)
        self.phase_steps = {1: 0, 2: 0}  # steps per phase, over all tensors

    def run_stats(self) -> dict:
        """Share of (tensor, step) exchanges in the learned phase, for the run summary."""
        total = self.phase_steps[1] + self.phase_steps[2]
        return {"lgc_learned_fraction": self.phase_steps[2] / total if total else 0.0, "lgc_phase_steps": dict(self.phase_steps)}

    def autoencoder(self, k: int, seed: int = 0) -> BlockAutoencoder:
        return BlockAutoencoder(k, self.code_ratio, self.hidden, self.block, seed)

    def coder(self, state: dict, k: int) -> BlockAutoencoder | None:
        """The trained coder (phase 2) or None (phase 1). Its weights live in
        ``state["coder_weights"]`` (checkpointed); the module is rebuilt in scratch."""
        w = state.get("coder_weights")
        if w is None:
            return None
        scratch = scratch_of(state)
        ae = scratch.get("coder")
        if ae is None or ae.k != k or scratch.get("coder_version") is not w:
            ae = scratch["coder"] = self.autoencoder(k)
            torch.nn.utils.vector_to_parameters(w.to(torch.float32), ae.parameters())
            scratch["coder_version"] = w
        return ae

    # single-rank codec: this rank's masked values, coded when the coder is trained
    def compress(self, tensor: torch.Tensor, state: dict) -> Payload:
        flat = tensor.reshape(-1)
        k = num_selected(flat.numel(), self.ratio)
        idx = torch.topk(flat.abs(), k, sorted=True).indices
        x = flat[idx]
        ae = self.coder(state, k)
        if ae is None:
            return Payload((x,), {"idx": idx, "numel": flat.numel()})
        s = max(float(torch.linalg.norm(x)) / math.sqrt(k), 1e-30)
        with torch.no_grad():
            z = ae.encode((x / s).float())
        return Payload((z,), {"idx": idx, "numel": flat.numel(), "coder": ae, "scale": s})

    def decompress(self, payload: Payload, shape: torch.Size) -> torch.Tensor:
        meta = payload.meta
        (vals,) = payload.tensors
        if "coder" in meta:
            with torch.no_grad():
                vals = meta["coder"].decode(vals.float()) * meta["scale"]
        out = torch.zeros(meta["numel"], dtype=vals.dtype, device=vals.device)
        out[meta["idx"]] = vals
        return out.reshape(shape)

    @staticmethod
    def _leader_pick(flat: torch.Tensor, k: int) -> torch.Tensor:
        """What the leader sends: its k largest |g| (indices, int32) and its scale s (float32
        bits as one int32 more)."""
        mine = torch.topk(flat.abs(), k, sorted=True).indices
        s = torch.linalg.norm(flat[mine].float()).reshape(1) / math.sqrt(k)
        return torch.cat([mine.to(torch.int32), s.view(torch.int32)])

    @staticmethod
    def _read_pick(got: torch.Tensor, device) -> tuple[torch.Tensor, float]:
        """(the shared mask, s) of a leader's :meth:`_leader_pick`."""
        s = float(got[-1:].view(torch.float32))
        return got[:-1].to(device=device, dtype=torch.int64), max(s, 1e-30)

    def _shared_mask(self, flat: torch.Tensor, step: int, k: int, collective: Collective):
        """The leader's k indices and its scale s (float32 bits appended as one int32)."""
        leader = step % collective.world_size
        rank = getattr(collective, "rank", 0)
        send = self._leader_pick(flat, k) if rank == leader else torch.empty(0, dtype=torch.int32, device=flat.device)
        return self._read_pick(collective.all_gather([send])[leader][0], flat.device)

    def _train(self, state: dict, k: int, collective: Collective) -> None:
        groups = state.get("samples")
        if groups is None or groups.shape[0] < 2:
            return
        scratch = scratch_of(state)
        ae = scratch.get("coder_training")
        if ae is None or ae.k != k:
            ae = scratch["coder_training"] = self.autoencoder(k, seed=int(state.get("key_hash", 0)) % (2**31))
        held = max(1, groups.shape[0] // 5)
        train_autoencoder(ae, groups[:-held], self.train_iters)
        # one coder on every rank: average the weights (identical data and seed make them
        # equal already; the average removes any rounding difference)
        flat = torch.nn.utils.parameters_to_vector(ae.parameters()).detach()
        (total,) = collective.all_reduce_sum([flat])
        torch.nn.utils.vector_to_parameters(total / collective.world_size, ae.parameters())
        err = sum_decode_error(ae, groups[-held:])
        state["last_fit_error"] = err
        if err <= self.max_error:
            state["coder_weights"] = torch.nn.utils.parameters_to_vector(ae.parameters()).detach().clone()
            state["samples"] = None
            state["ema_error"] = err
            log.info("compression=lgc: coder trained (held-out error %.3f <= compression.max_error %.3f); codes from now on", err, self.max_error)
        else:
            log.warning(
                "compression=lgc: held-out reconstruction error %.3f > compression.max_error %.3f "
                "on %d steps of vectors; top-k with the shared mask for %d more steps",
                err, self.max_error, groups.shape[0], self.coder_warmup_steps,
            )

    def aggregate(self, tensor: torch.Tensor, state: dict, collective: Collective):
        """Shared mask, then phase 1 (values all-gathered) or phase 2 (codes)."""
        world = collective.world_size
        flat = tensor.reshape(-1)
        k = num_selected(flat.numel(), self.ratio)
        step = int(state.get("step", 0))
        state["step"] = step + 1
        idx, s = self._shared_mask(flat, step, k, collective)
        x = flat[idx]
        ae = self.coder(state, k)
        local = torch.zeros_like(flat)
        mean = torch.zeros_like(flat)
        if ae is None:  # phase 1: top-k with the shared mask; every worker's x kept
            parts = collective.all_gather([x])
            xs = torch.stack([p[0].to(flat.device, flat.dtype) for p in parts])
            self._phase1_end(state, k, x, xs, s, idx, local, mean, collective)
        else:
            zt, mine = self._phase2_code(ae, x, s)
            if self.style == "ring":
                (zt_sum,) = collective.all_reduce_sum([zt])
            else:  # every rank plays the server: the gathered codes summed, decoded once
                zt_sum = torch.stack([p[0].to(zt.device, zt.dtype) for p in collective.all_gather([zt])]).sum(0)
            self._phase2_end(state, ae, zt_sum, mine, s, idx, local, mean, world)
        return mean.view(tensor.shape), local.view(tensor.shape)

    def _phase1_end(self, state: dict, k: int, x, xs, s: float, idx, local, mean, collective) -> None:
        """Phase 1 of one tensor, its workers' masked values ``xs`` gathered: kept as
        training data, sent as they are (``local``, ``mean`` at the mask); the coder trained
        every ``coder_warmup_steps`` such steps."""
        old = state.get("samples")
        new = (xs / s).float().unsqueeze(0)
        state["samples"] = new if old is None or old.shape[2] != k else torch.cat([old, new])[-MAX_GROUPS:]
        local[idx] = x
        mean[idx] = xs.sum(0) / collective.world_size
        state["last_phase"] = 1
        state["phase1_steps"] = int(state.get("phase1_steps", 0)) + 1
        if state["phase1_steps"] % self.coder_warmup_steps == 0:
            self._train(state, k, collective)
        self.phase_steps[1] += 1

    @staticmethod
    def _phase2_code(ae, x, s: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(code and relative error, what it decodes to) of one tensor's masked values."""
        with torch.no_grad():
            z = ae.encode((x / s).float())
            mine = ae.decode(z).to(x.dtype) * s
        xn = float(torch.linalg.norm(x))
        err = float(torch.linalg.norm(x - mine)) / xn if xn > 0 else 0.0
        return torch.cat([z, z.new_tensor([err])]), mine

    def _phase2_end(self, state: dict, ae, zt_sum, mine, s: float, idx, local, mean, world: int) -> None:
        """Phase 2 of one tensor, its codes summed: decoded once; the running error, and
        back to phase 1 when it passes ``max_error``."""
        with torch.no_grad():
            local[idx] = mine
            mean[idx] = ae.decode(zt_sum[:-1]).to(mean.dtype) * (s / world)
        ema = state["ema_error"] = EMA * float(state.get("ema_error", 0.0)) + (1 - EMA) * float(zt_sum[-1]) / world
        state["last_phase"] = 2
        if ema > self.max_error:
            log.warning(
                "compression=lgc: running reconstruction error %.3f > compression.max_error %.3f; "
                "back to top-k with the shared mask to retrain", ema, self.max_error,
            )
            state["coder_weights"] = None
            state["phase1_steps"] = 0
        self.phase_steps[2] += 1

    def rounds_segments(self, flat: torch.Tensor, segments: Segments, state: dict, collective, out: torch.Tensor):
        """The fused exchange's rounds: every tensor's shared mask in ONE all-gather (each
        from its own leader), then the tensors in phase 1 their masked values in ONE
        all-gather and those in phase 2 their codes in ONE all-reduce (``ps``: all-gather);
        each tensor its own coder, samples and phase (``segment_states``); every segment's
        mean written into ``out``; returns this rank's transmitted buffer (None unless
        :func:`~.base.wants_local`). A coder's training (its weights' all-reduce) stays per
        tensor, on the rare steps it happens."""
        world, rank = collective.world_size, getattr(collective, "rank", 0)
        own = state.setdefault(SEGMENT_STATES, [{} for _ in range(len(segments))])
        hashes = segments.key_hashes or (0,) * len(segments)
        ks = [num_selected(n, self.ratio) for n in segments.lengths]
        leaders = []
        for st, h in zip(own, hashes):
            step = int(st.get("step", 0))
            st["key_hash"], st["step"] = h, step + 1
            leaders.append(step % world)
        picks = [self._leader_pick(flat[off : off + n], k)
                 for (off, n), k, lead in zip(segments, ks, leaders) if lead == rank]
        rows = collective.all_gather([torch.cat(picks) if picks else torch.empty(0, dtype=torch.int32, device=flat.device)])
        at = [0] * world
        masks = []
        for k, lead in zip(ks, leaders):  # each leader's message: its tensors' picks in order
            masks.append(self._read_pick(rows[lead][0][at[lead] : at[lead] + k + 1], flat.device))
            at[lead] += k + 1
        xs = [flat[off : off + n][idx] for (off, n), (idx, _) in zip(segments, masks)]
        coders = [self.coder(st, k) for st, k in zip(own, ks)]
        ones = [j for j, ae in enumerate(coders) if ae is None]
        twos = [(j, *self._phase2_code(coders[j], xs[j], masks[j][1])) for j in range(len(segments)) if coders[j] is not None]
        h1 = start_collective(collective, "all_gather", [torch.cat([xs[j] for j in ones])]) if ones else None
        zts = [torch.cat([zt for _, zt, _ in twos])] if twos else []
        h2 = None if not twos else start_collective(
            collective, "all_reduce_sum" if self.style == "ring" else "all_gather", zts)
        yield
        local = scratch_buffer(scratch_of(state), "local", flat.numel(), flat.dtype, flat.device).zero_()
        for off, n in segments:
            out[off : off + n].zero_()
        if h1 is not None:
            gathered, pos = h1.wait(), 0
            for j in ones:
                off, n, k, (idx, s) = segments.offsets[j], segments.lengths[j], ks[j], masks[j]
                xs_j = torch.stack([row[0][pos : pos + k].to(flat.device, flat.dtype) for row in gathered])
                pos += k
                self._phase1_end(own[j], k, xs[j], xs_j, s, idx, local[off : off + n], out[off : off + n], collective)
        if h2 is not None:
            got = h2.wait()
            summed = got[0] if self.style == "ring" else torch.stack([row[0].to(zts[0].device, zts[0].dtype) for row in got]).sum(0)
            pos = 0
            for j, zt, mine in twos:
                off, n = segments.offsets[j], segments.lengths[j]
                idx, s = masks[j]
                self._phase2_end(own[j], coders[j], summed[pos : pos + zt.numel()], mine, s, idx,
                                 local[off : off + n], out[off : off + n], world)
                pos += zt.numel()
        return local if wants_local(state) else None
