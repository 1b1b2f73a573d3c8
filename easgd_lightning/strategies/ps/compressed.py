"""Compressed parameter-server messages: pushes of the SGD rule (``async_sgd``, ``async_msgd``),
one-way or both ways (``compression.two_way``; Zhong et al., 2021), the server keeping the
second residual; and elastic differences of the EASGD rule (``async_easgd``,
``async_measgd``; the EASGD rule of Zhang et al. 2015 with error feedback, Seide et al. 2014).

Rule, C the configured compressor (one of :data:`PS_COMPRESSORS`), per parameter tensor
(tensors with fewer than ``compression.min_numel`` entries travel dense), worker i, push t:

  worker -> server:  p = g_i + e_i;  c = C(p);  e_i <- p - c
                     (e_i: error feedback when ``compression.memory`` is on, the compressor's
                     default otherwise); the server decodes c and steps the user's optimizer
                     (Adam, SGD, ...) with it, as ``async_sgd`` steps it for a dense gradient.
  server -> worker, one-way: the dense center w, as uncompressed ``async_sgd`` replies.
  server -> worker, two-way: q = w - r_i;  d = C(q);  r_i <- r_i + d;  the worker adds d to
                     its weights, which stay equal to r_i. r_i is the server's replica of
                     worker i's weights, so the second residual is f_i = q - d = w - r_i after
                     the reply: what the center moved since worker i's last reply (its own
                     update and every other worker's), plus what earlier replies left out.
                     The server keeps one per worker, because asynchronous workers have each
                     seen a different part of the center's moves (on the ring every rank sees
                     the same mean, so each owner keeps one residual per shard: see
                     :mod:`easgd_lightning.hooks.compressors.two_way`).

Nothing is lost in either direction: sum_t c_t + e_i = sum_t g_t on every worker, and
sum_t d_t + f_i = w_now - w_start per worker at the server. Floating-point buffers travel
dense both ways (the server overwrites its copy, as for dense pushes).

Compressed elastic exchanges (``async_easgd``, ``async_measgd``), worker i, exchange t.
Both ends keep x~_i, the server's estimate of worker i's variable (x~_i = the start center
at first); the form is CHOCO-SGD's compressed reference (Koloskova, Stich, Jaggi, ICML 2019)
under the Async EASGD rule (Zhang, Choromanska, LeCun, NeurIPS 2015):

  worker -> server:  q = x_i - x~_i;  m = C(q);  x~_i <- x~_i + C(q)  (parameters; float
                     buffers travel dense, as x_i's own). e_i = q - C(q) = x_i - x~_i is
                     the error-feedback residual: what earlier pushes left out rides along
                     in the next q, so x~_i + e_i = x_i after every push.
  server:            x~_i <- x~_i + C(q);  d = alpha (x~_i - c);  c <- c + d (the EASGD rule
                     on the server's picture of x_i, :func:`~.rules.server_elastic_update`).
  server -> worker:  the dense d (as uncompressed ``async_easgd``); the worker sets
                     x_i <- x_i - d and both ends x~_i <- x~_i - d, with the same operations
                     on the same values, so the two copies of x~_i agree bitwise.

  The reply is not compressed: d is what moves the worker and the center, and compressing
  it would need a second residual per worker (as two-way SGD pushes keep), so
  ``compression.two_way`` is refused for these rules; the compressor's ``memory`` option
  does not apply (x~_i is the feedback). Nothing is lost: what C leaves out of x_i - x~_i
  stays in it until a later push carries it.

Wire form (one uint8 message each way): an int32 header listing, per payload tensor, its
dtype code, number of dimensions and sizes; then the tensors' bytes. ``payload.meta`` stays
local (as on the ring): each side derives it from the compressor and the tensor's size.
A codec with a fused form (``fused_segments``: ``topk``, ``signsgd``, ``qsgd``, ``redsync``, ``sidco``,
``gcomp``) encodes the
whole parameter part in one call (each tensor keeping its own rule, the same numbers) and
its payload tensors come first; the tensors under ``min_numel`` follow, dense.
Replicas, residuals and compressor states are not checkpointed: a resume restarts every
worker from the center, so both sides start again from r_i = w. A restarted worker
(``ft=torchft``) does the same alone: its fresh push state and the server's ``reset`` of its
replica start from the center the server sent it when it rejoined.
"""

from __future__ import annotations

import copy

import torch

from easgd_lightning.hooks.compressors.base import Compressor, Payload, has_fused_form
from easgd_lightning.hooks.compressors.segments import Segments
from easgd_lightning.hooks.compressors.two_way import TWO_WAY_INNER, TwoWayCompressor
from easgd_lightning.hooks.memory import ResidualMemory

__all__ = ["PS_COMPRESSORS", "MessageCodec", "WorkerPush", "ServerReplies", "ElasticPush", "ElasticReplies", "unwrap"]

#: compressors whose payload decodes from itself (no per-step seed or shared state)
PS_COMPRESSORS = TWO_WAY_INNER

_PUSH = "push"  # the worker's one residual memory key: the flat parameter part

_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
           torch.bfloat16, torch.float32, torch.float64, torch.bool)


def unwrap(compression, who: str) -> tuple[Compressor, bool]:
    """(the compressor, two_way) of a ``compression`` object; ValueError naming the key."""
    two_way = isinstance(compression, TwoWayCompressor)
    inner = compression.inner if two_way else compression
    if getattr(inner, "name", None) not in PS_COMPRESSORS:
        raise ValueError(
            f"compression.name: {who} compresses its pushes with one of {list(PS_COMPRESSORS)}, "
            f"got {getattr(inner, 'name', inner)!r}"
        )
    return inner, two_way


class MessageCodec:
    """One flat vector (parameter segments of ``sizes``, then dense buffers) <-> one uint8 message."""

    def __init__(self, compressor: Compressor, sizes: list[int]) -> None:
        self.compressor = compressor
        self.sizes = [int(n) for n in sizes]
        self.n_params = sum(self.sizes)
        self.bounds = []
        start = 0
        for n in self.sizes:
            self.bounds.append((start, start + n))
            start += n
        self.dense = [n < compressor.min_numel for n in self.sizes]
        self._templates: dict = {}
        self._probe = copy.deepcopy(compressor)  # derives metas without touching C's own state
        comp = [j for j, d in enumerate(self.dense) if not d]
        #: the compressed segments, encoded by one codec call when the codec has a fused form
        self.segments = Segments([self.bounds[j][0] for j in comp], [self.sizes[j] for j in comp], self.n_params)
        self.fused = has_fused_form(compressor) and bool(comp)
        self._scratch: dict = {}  # the decode's buffers (fused)

    def new_states(self) -> list[dict]:
        """Fresh codec states for one sender: one per segment, then the fused exchange's."""
        return [{} for _ in self.sizes] + [{}]

    def _fused_template(self, dtype: torch.dtype) -> tuple[dict, int]:
        """(meta, tensor count) of the fused payload (data-independent, as :meth:`template`)."""
        key = ("fused", dtype)
        if key not in self._templates:
            payload = self._probe.compress_segments(torch.zeros(self.n_params, dtype=dtype), self.segments, {})
            meta = {k: v for k, v in payload.meta.items() if k != "out"}
            self._templates[key] = (meta, len(payload.tensors))
        return self._templates[key]

    def template(self, numel: int, dtype: torch.dtype) -> tuple[dict, int]:
        """(``payload.meta``, number of payload tensors) of a ``numel``-entry tensor; both
        data-independent, as the ring assumes too."""
        key = (numel, dtype)
        if key not in self._templates:
            payload = self._probe.compress(torch.zeros(numel, dtype=dtype), {})
            meta = dict(payload.meta)
            meta.pop("out", None)
            self._templates[key] = (meta, len(payload.tensors))
        return self._templates[key]

    def encode(self, vec: torch.Tensor, states: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the message, the decoded parameter part) of ``vec``; ``states``: one per segment."""
        header: list[int] = []
        parts: list[torch.Tensor] = []
        decoded = torch.empty(self.n_params, dtype=vec.dtype, device=vec.device)
        if self.fused:  # one codec call over the parameter part; the dense segments after it
            payload = self.compressor.compress_segments(vec[: self.n_params], self.segments, states[-1])
            tensors = tuple(t.detach().contiguous() for t in payload.tensors)
            decoded.copy_(self.compressor.local_segments(Payload(tensors, payload.meta), self.segments, states[-1]))
            for t in tensors:
                header += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
                parts.append(t.reshape(-1).view(torch.uint8))
        for j, (a, b) in enumerate(self.bounds):
            seg = vec[a:b]
            if self.fused and not self.dense[j]:
                continue
            if self.dense[j]:
                tensors = (seg,)
                decoded[a:b] = seg
            else:
                payload = self.compressor.compress(seg, states[j])
                tensors = tuple(t.detach().contiguous() for t in payload.tensors)
                shown = self.compressor.decompress(Payload(tensors, self.template(b - a, vec.dtype)[0]), seg.shape)
                decoded[a:b] = shown.reshape(-1).to(vec.dtype)
            for t in tensors:
                header += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
                parts.append(t.contiguous().reshape(-1).view(torch.uint8))
        parts.append(vec[self.n_params :].contiguous().view(torch.uint8))  # buffers, dense
        head = torch.tensor([len(header), *header], dtype=torch.int32)
        return torch.cat([head.view(torch.uint8), *[p.cpu() for p in parts]]), decoded

    def decode(self, message: torch.Tensor, dtype: torch.dtype, n_total: int) -> torch.Tensor:
        """The flat vector (decoded parameter part, then the dense buffers) of a message."""
        length = int(message[:4].view(torch.int32)[0])
        header = message[4 : 4 * (1 + length)].view(torch.int32).tolist()
        pos, h = 4 * (1 + length), 0
        out = torch.empty(n_total, dtype=dtype)

        def take() -> torch.Tensor:
            nonlocal pos, h
            dt, ndim = _DTYPES[header[h]], header[h + 1]
            shape = header[h + 2 : h + 2 + ndim]
            h += 2 + ndim
            count = 1
            for s in shape:
                count *= s
            nbytes = count * torch.empty(0, dtype=dt).element_size()
            t = message[pos : pos + nbytes].clone().view(dt).reshape(shape)
            pos += nbytes
            return t

        if self.fused:
            meta, n_tensors = self._fused_template(dtype)
            tensors = tuple(take() for _ in range(n_tensors))
            out[: self.n_params] = self.compressor.local_segments(Payload(tensors, meta), self.segments, self._scratch)
        for j, (a, b) in enumerate(self.bounds):
            if self.dense[j]:
                out[a:b] = take()
                continue
            if self.fused:
                continue
            meta, n_tensors = self.template(b - a, dtype)
            tensors = tuple(take() for _ in range(n_tensors))
            out[a:b] = self.compressor.decompress(Payload(tensors, meta), torch.Size([b - a])).reshape(-1).to(dtype)
        out[self.n_params :] = message[pos:].clone().view(dtype)
        return out


class _PushTraffic:
    """What a worker's side counts, one-way or elastic: its pushes and the payload bytes it
    sent and got back (headers not counted), in ``traffic``; the last message's size in
    ``last_message_bytes``."""

    def __init__(self, start: torch.Tensor) -> None:
        self.last_message_bytes = 0
        self.traffic = {"pushes": 0, "bytes_up": 0, "bytes_down": 0,
                        "dense_bytes_per_direction": start.numel() * start.element_size()}

    def _sent(self, message: torch.Tensor) -> torch.Tensor:
        """Count one push of ``message`` (bytes); returns it."""
        self.last_message_bytes = int(message.numel())
        self.traffic["pushes"] += 1
        self.traffic["bytes_up"] += self.last_message_bytes
        return message

    def _received(self, reply: torch.Tensor) -> None:
        """Count the bytes of one reply."""
        self.traffic["bytes_down"] += reply.numel() * reply.element_size()


class WorkerPush(_PushTraffic):
    """A worker's side: compresses each push with its residual e_i; two-way, applies the
    server's compressed d to its weights (which equal the server's replica r_i)."""

    def __init__(self, compressor: Compressor, sizes: list[int], start: torch.Tensor, two_way: bool) -> None:
        self.codec = MessageCodec(compressor, sizes)
        self.two_way = two_way
        self.memory = compressor.memory
        self.states = self.codec.new_states()
        self._residuals = ResidualMemory()
        self._residuals.adopt(_PUSH, torch.zeros(self.codec.n_params, dtype=start.dtype))
        self.weights = start.detach().cpu().clone()
        super().__init__(start)

    @property
    def residual(self) -> torch.Tensor:
        """e: what the pushes so far left out of the parameter part (zeros without memory)."""
        return self._residuals.residual(_PUSH)

    def encode(self, vec: torch.Tensor) -> torch.Tensor:
        """The message of the flat gradient (then buffers) ``vec``: p = g + e; send C(p); e = p - C(p)."""
        vec = vec.detach().cpu().clone()
        n = self.codec.n_params
        if self.memory:
            p = self._residuals.compensate(_PUSH, vec[:n])
            vec[:n] = p
        message, sent = self.codec.encode(vec, self.states)
        if self.memory:
            self._residuals.update(_PUSH, p, sent)
        return self._sent(message)

    def apply(self, reply: torch.Tensor) -> torch.Tensor:
        """The worker's weights after a reply (one-way: the dense center; two-way: w += d)."""
        self._received(reply)
        if not self.two_way:
            self.weights = reply.detach().cpu().clone()
            return self.weights
        d = self.codec.decode(reply, self.weights.dtype, self.weights.numel())
        n = self.codec.n_params
        self.weights[:n] += d[:n]
        self.weights[n:] = d[n:]
        return self.weights


class ServerReplies:
    """The server's side: decodes pushes; two-way, keeps each worker's replica r_i (so its
    second residual f_i = w - r_i) and compresses w - r_i for the reply."""

    def __init__(self, compressor: Compressor, sizes: list[int], center: torch.Tensor,
                 workers: list[int], two_way: bool) -> None:
        self.codec = MessageCodec(compressor, sizes)
        self.two_way = two_way
        self.n_total = center.numel()
        self.replicas = {w: center.detach().cpu().clone() for w in workers} if two_way else {}
        self.states = {w: self.codec.new_states() for w in workers}

    def decode_push(self, message: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.codec.decode(message, dtype, self.n_total)

    def reset(self, worker: int, center: torch.Tensor) -> None:
        """Worker ``worker`` starts again from ``center`` (a restarted process, with a fresh
        :class:`WorkerPush` from the same center): r_i = w, fresh compressor states."""
        if self.two_way:
            self.replicas[worker] = center.detach().cpu().clone()
        self.states[worker] = self.codec.new_states()

    def residual(self, worker: int, center: torch.Tensor) -> torch.Tensor:
        """f_i = w - r_i (parameters): what the server still owes worker ``worker``."""
        n = self.codec.n_params
        return center.detach().cpu()[:n] - self.replicas[worker][:n]

    def reply(self, worker: int, center: torch.Tensor) -> torch.Tensor:
        """The message d = C(w - r_i) (then the dense buffers); r_i <- r_i + d."""
        w = center.detach().cpu()
        n = self.codec.n_params
        r = self.replicas[worker]
        q = torch.cat([w[:n] - r[:n], w[n:]])
        message, d = self.codec.encode(q, self.states[worker])
        r[:n] += d
        r[n:] = w[n:]
        return message


class ElasticPush(_PushTraffic):
    """A worker's side of compressed elastic exchanges (``async_easgd``, ``async_measgd``).

    Holds x~, the server's estimate of this worker's variable (both ends keep it, updated by
    the same operations on the same values, so they agree bitwise). :meth:`encode` sends
    ``C(x - x~)`` (parameters; floating-point buffers travel dense, as x's own) and adds the
    decompressed message to x~; :meth:`apply` takes the server's dense reply d and moves x~
    by ``-d``, as the worker moves x. ``x - x~`` is the error-feedback residual: what the
    pushes so far have left out, which the next push carries.
    """

    two_way = False

    def __init__(self, compressor: Compressor, sizes: list[int], start: torch.Tensor, alpha: float) -> None:
        self.codec = MessageCodec(compressor, sizes)
        self.alpha = float(alpha)
        self.states = self.codec.new_states()
        self.estimate = start.detach().cpu().clone()
        self.residual = torch.zeros(self.codec.n_params, dtype=start.dtype)
        super().__init__(start)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The message of the worker's variable ``x`` (flat: parameters, then buffers):
        q = x - x~ (e + what moved since the last push); send C(q); x~ += C(q); e = q - C(q)."""
        x = x.detach().cpu()
        n = self.codec.n_params
        q = x.clone()
        q[:n] -= self.estimate[:n]
        message, sent = self.codec.encode(q, self.states)
        self.estimate[:n] += sent
        self.estimate[n:] = x[n:]
        self.residual = q[:n] - sent
        return self._sent(message)

    def apply(self, d: torch.Tensor) -> torch.Tensor:
        """The server's dense elastic difference d: x~ -= d (the worker subtracts d from x); returns d."""
        self._received(d)
        self.estimate -= d.detach().cpu()
        return d


class ElasticReplies:
    """The server's side of compressed elastic exchanges: x~_i per worker (its estimate of
    worker i's variable); :meth:`serve` adds the decompressed push to x~_i, applies the EASGD
    rule with it, moves x~_i by -d as the worker moves, and returns the dense d."""

    two_way = False

    def __init__(self, compressor: Compressor, sizes: list[int], center: torch.Tensor,
                 workers: list[int], alpha: float) -> None:
        self.codec = MessageCodec(compressor, sizes)
        self.alpha = float(alpha)
        self.n_total = center.numel()
        self.estimates = {w: center.detach().cpu().clone() for w in workers}

    def reset(self, worker: int, center: torch.Tensor) -> None:
        """Worker ``worker`` starts again from ``center`` (a restarted process, with a fresh
        :class:`ElasticPush` from the same center): x~_i = the center, as at the start."""
        self.estimates[worker] = center.detach().cpu().clone()

    def serve(self, worker: int, message: torch.Tensor, center: torch.Tensor) -> torch.Tensor:
        """x~ += C(q); d = alpha (x~ - c); c <- c + d (in place); x~ -= d; returns d."""
        from easgd_lightning.strategies.ps.rules import server_elastic_update

        n = self.codec.n_params
        q = self.codec.decode(message, center.dtype, self.n_total)
        estimate = self.estimates[worker]
        estimate[:n] += q[:n]
        estimate[n:] = q[n:]
        d = server_elastic_update(center, estimate.to(center.device), self.alpha)
        estimate -= d.detach().cpu()
        return d
