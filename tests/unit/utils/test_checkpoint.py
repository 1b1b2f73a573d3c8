"""Checkpoint state and integrity (easgd_lightning/utils/checkpoint.py) and the pre-launch
``checkpoint.resume`` check (easgd_lightning/cli/resume.py:check_resume), in-process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from easgd_lightning.hooks._exchange import exchange_tensors
from easgd_lightning.hooks.compressors import build_compressor
from easgd_lightning.hooks.memory import ResidualMemory
from easgd_lightning.utils.checkpoint import (
    CHECKSUM_KEY,
    CheckpointError,
    content_digest,
    from_plain,
    load_checkpoint_file,
    save_checkpoint_file,
    to_plain,
)
from tests.helpers import MeteredSoloCollective
from tests.helpers import compose as _compose


def _weights_only_roundtrip(obj, tmp_path: Path):
    path = tmp_path / "state.pt"
    torch.save(obj, path)
    return torch.load(path, weights_only=True)


def test_plain_state_round_trips_memory_generator_and_drops_scratch(tmp_path: Path) -> None:
    mem = ResidualMemory(decay=0.5)
    mem.update("w", torch.arange(6.0).view(2, 3), torch.ones(2, 3))
    gen = torch.Generator().manual_seed(7)
    torch.rand(3, generator=gen)  # advance it
    state = {
        "_memory": mem,
        "flat.0": {"step": 3, "q": torch.randn(4, 2), "_scratch": {"mean": torch.zeros(8)}},
        "gen": gen,
        "shape": torch.Size([2, 3]),
    }
    plain = _weights_only_roundtrip(to_plain(state), tmp_path)  # loads without any allow-list
    assert "_scratch" not in plain["flat.0"]
    back = from_plain(plain)
    assert isinstance(back["_memory"], ResidualMemory) and back["_memory"].decay == 0.5
    torch.testing.assert_close(back["_memory"].residual("w"), torch.arange(6.0).view(2, 3) - 1, rtol=0, atol=0)
    assert torch.equal(back["flat.0"]["q"], state["flat.0"]["q"]) and back["flat.0"]["step"] == 3
    # the generator continues exactly where the saved one would
    assert torch.equal(torch.rand(5, generator=back["gen"]), torch.rand(5, generator=gen))
    assert tuple(back["shape"]) == (2, 3)


def test_unknown_object_is_refused_naming_where_it_is() -> None:
    class Opaque:
        pass

    with pytest.raises(TypeError, match=r"state\['flat.0'\]\['thing'\] holds a .*Opaque"):
        to_plain({"flat.0": {"thing": Opaque()}})


def _exchange(state: dict, diff: torch.Tensor, comp) -> torch.Tensor:
    """One compressed exchange as exchange_sum runs it (its memory kept inside ``state``)."""
    memory = state.setdefault("_memory", ResidualMemory())
    (mean,), _ = exchange_tensors([diff.clone()], ["flat"], comp, memory, state, MeteredSoloCollective())
    return mean


@pytest.mark.parametrize("name,options", [("topk", {"ratio": 0.1}), ("powersgd", {"rank": 1})])
def test_exchange_state_resumes_exactly_after_a_weights_only_round_trip(tmp_path: Path, name, options) -> None:
    """After to_plain / torch.save / weights_only load / from_plain, the next exchanges are
    bitwise those of an uninterrupted run; without the state they are not."""
    comp = build_compressor(name, min_numel=0, **options)
    gen = torch.Generator().manual_seed(0)
    diffs = [torch.randn(16, 8, generator=gen, dtype=torch.float64) for _ in range(6)]
    straight: dict = {}
    out_straight = [_exchange(straight, d, comp) for d in diffs]
    state: dict = {}
    for d in diffs[:3]:
        _exchange(state, d, comp)
    state = from_plain(_weights_only_roundtrip(to_plain(state), tmp_path))
    out_resumed = [_exchange(state, d, comp) for d in diffs[3:]]
    for a, b in zip(out_straight[3:], out_resumed):
        assert torch.equal(a, b)
    assert not torch.equal(_exchange({}, diffs[3], comp), out_straight[3])


def _exchange_two(state: dict, diffs: tuple[torch.Tensor, torch.Tensor], comp) -> list[torch.Tensor]:
    memory = state.setdefault("_memory", ResidualMemory())
    means, _ = exchange_tensors([d.clone() for d in diffs], ["w", "b"], comp, memory, state, MeteredSoloCollective())
    return means


@pytest.mark.parametrize(
    "name,options",
    [
        ("qsgd", {"levels": 4, "bucket_size": 32}),  # seed null: noise seeded from the global RNG
        # fixed link and compute time: the ratio depends on N = 128 + 64 (both tensors seen)
        ("adaptive", {"bandwidth": 2e4, "compute_time": 0.01, "exact": True}),
    ],
)
def test_compressor_state_resumes_exactly(tmp_path: Path, name, options) -> None:
    """A fresh compressor given the saved compressor state (plus the per-tensor states)
    continues bitwise like the one that never stopped; without it, it does not."""
    gen = torch.Generator().manual_seed(1)
    steps = [(torch.randn(16, 8, generator=gen, dtype=torch.float64),
              torch.randn(64, generator=gen, dtype=torch.float64)) for _ in range(5)]

    torch.manual_seed(0)
    comp = build_compressor(name, min_numel=0, **options)
    straight: dict = {}
    out_straight = [_exchange_two(straight, d, comp) for d in steps]

    torch.manual_seed(0)
    first = build_compressor(name, min_numel=0, **options)
    state: dict = {}
    for d in steps[:2]:
        _exchange_two(state, d, first)
    saved = _weights_only_roundtrip({"tensors": to_plain(state), "compressor": to_plain(first.state_dict())},
                                    tmp_path)
    torch.manual_seed(123)  # the global RNG is not part of a checkpoint
    resumed = build_compressor(name, min_numel=0, **options)
    resumed.load_state_dict(from_plain(saved["compressor"]))
    state = from_plain(saved["tensors"])
    out_resumed = [_exchange_two(state, d, resumed) for d in steps[2:]]
    for a, b in zip(out_straight[2:], out_resumed):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    if name == "adaptive":
        assert 0 < resumed.last_ratio < 0.25  # sparse, not clamped: the rule decided it

    blank = build_compressor(name, min_numel=0, **options)  # per-tensor state alone is not enough
    again = _exchange_two(from_plain(saved["tensors"]), steps[2], blank)
    assert not all(torch.equal(x, y) for x, y in zip(again, out_straight[2]))


# ---------------------------------------------------------------------- files
def _checkpoint() -> dict:
    gen = torch.Generator().manual_seed(1)
    return {
        "epoch": 1,
        "state_dict": {"net.0.weight": torch.randn(128, 64, generator=gen, dtype=torch.float64)},
        "easgd": {"strategy": "sync_easgd", "world_size": 2, "steps": [16, 16]},
    }


def test_saved_checkpoint_has_checksum_and_loads_weights_only(tmp_path: Path) -> None:
    path = tmp_path / "a.ckpt"
    save_checkpoint_file(_checkpoint(), path)
    raw = torch.load(path, weights_only=True)
    assert raw[CHECKSUM_KEY]["algorithm"] == "sha256"
    assert raw[CHECKSUM_KEY]["digest"] == content_digest(raw)
    loaded = load_checkpoint_file(path)
    assert torch.equal(loaded["state_dict"]["net.0.weight"], _checkpoint()["state_dict"]["net.0.weight"])
    # the digest covers the tensor bytes: one value changed by 1e-12 changes it
    changed = _checkpoint()
    changed["state_dict"]["net.0.weight"][5, 5] += 1e-12
    assert content_digest(changed) != content_digest(_checkpoint())


def _overwrite_middle(path: Path, count: int = 64) -> None:
    """Overwrite ``count`` float64 values in the middle of the file (as the issue did)."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 8 * count] = torch.full((count,), 3.0, dtype=torch.float64).numpy().tobytes()
    path.write_bytes(bytes(data))


def test_corrupted_tensor_bytes_are_refused_naming_the_file(tmp_path: Path) -> None:
    """64 values overwritten inside a tensor: torch.load alone accepts the file; the
    checksum does not."""
    path = tmp_path / "corrupt.ckpt"
    ckpt = _checkpoint()
    save_checkpoint_file(ckpt, path)
    data = bytearray(path.read_bytes())
    raw = ckpt["state_dict"]["net.0.weight"].numpy().tobytes()
    start = data.index(raw) + len(raw) // 2
    data[start : start + 64 * 8] = torch.full((64,), 3.0, dtype=torch.float64).numpy().tobytes()
    path.write_bytes(bytes(data))
    torch.load(path, weights_only=True)  # still a readable file
    with pytest.raises(CheckpointError) as err:
        load_checkpoint_file(path)
    assert str(err.value) == f"{path} is corrupted: its content does not match the checksum written with it"


def test_middle_of_file_overwritten_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "corrupt.ckpt"
    save_checkpoint_file(_checkpoint(), path)
    _overwrite_middle(path)
    with pytest.raises(CheckpointError, match=str(path)) as err:
        load_checkpoint_file(path)
    assert "corrupted" in str(err.value) or "not a readable checkpoint" in str(err.value)


@pytest.mark.parametrize("kind", ["missing", "empty", "truncated", "garbage", "pickled_object"])
def test_unusable_files_are_refused(tmp_path: Path, kind: str) -> None:
    path = tmp_path / f"{kind}.ckpt"
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "truncated":
        save_checkpoint_file(_checkpoint(), path)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif kind == "garbage":
        path.write_bytes(b"this is not a checkpoint\n" * 40)
    elif kind == "pickled_object":  # what the old sync_easgd + compression checkpoints held
        torch.save({"state": ResidualMemory()}, path)
    expected = {"missing": "no such file", "empty": "is empty"}.get(kind, "not a readable checkpoint")
    with pytest.raises(CheckpointError, match=expected) as err:
        load_checkpoint_file(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------------- pre-launch check
def _mlp_state(hidden: int = 128) -> dict:
    return {
        "net.1.weight": torch.zeros(hidden, 64),
        "net.1.bias": torch.zeros(hidden),
        "net.3.weight": torch.zeros(10, hidden),
        "net.3.bias": torch.zeros(10),
    }


def _written(tmp_path: Path, strategy: str = "sync_easgd", world: int = 2, hidden: int = 128) -> Path:
    key = "ddp" if strategy == "ddp" else "easgd"
    path = tmp_path / f"{strategy}_{world}_{hidden}.ckpt"
    save_checkpoint_file({"state_dict": _mlp_state(hidden), key: {"strategy": strategy, "world_size": world}}, path)
    return path


def _resume_error(overrides: list[str]) -> str:
    from easgd_lightning.cli.validate import ConfigError, validate_config

    with pytest.raises(ConfigError) as err:
        validate_config(_compose(overrides))
    message = str(err.value)
    assert message.startswith("checkpoint.resume: ") and "\n" not in message
    return message


def test_resume_of_a_matching_checkpoint_validates(tmp_path: Path) -> None:
    from easgd_lightning.cli.validate import validate_config

    path = _written(tmp_path)
    validate_config(_compose(["strategy=sync_easgd", f"checkpoint.resume={path}"]))


def test_mlp_state_matches_the_real_module() -> None:
    """The hand-written shapes above are those of model=mlp on digits (else the refusal
    tests below would pass for the wrong reason)."""
    from easgd_lightning.cli.build import build_data
    from easgd_lightning.cli.validate import meta_module

    cfg = _compose([])
    module = meta_module(cfg, build_data(cfg))
    assert {k: tuple(v.shape) for k, v in module.state_dict().items()} == {
        k: tuple(v.shape) for k, v in _mlp_state().items()
    }


@pytest.mark.parametrize(
    "written,overrides,expected",
    [
        (dict(strategy="sync_easgd"), ["strategy=ddp"], "was written by strategy=sync_easgd; this run has strategy=ddp"),
        (dict(strategy="ddp"), ["strategy=local_sgd"], "was written by strategy=ddp; this run has strategy=local_sgd"),
        (dict(world=4), ["strategy=sync_easgd"], "was written by 4 processes; this run has 2"),
        (dict(hidden=256), ["strategy=sync_easgd"], "holds another model than model=mlp"),
    ],
)
def test_resume_of_another_run_is_refused(tmp_path: Path, written: dict, overrides: list[str], expected: str) -> None:
    path = _written(tmp_path, **written)
    message = _resume_error([*overrides, f"checkpoint.resume={path}"])
    assert expected in message and str(path) in message


@pytest.mark.parametrize("kind", ["missing", "empty", "garbage", "corrupted"])
def test_resume_of_an_unusable_file_is_refused(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "x.ckpt"
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "garbage":
        path.write_bytes(b"\x00\x01garbage" * 100)
    elif kind == "corrupted":
        path = _written(tmp_path)
        _overwrite_middle(path, count=8)
    message = _resume_error(["strategy=sync_easgd", f"checkpoint.resume={path}"])
    assert str(path) in message


def _pipeline_dir(tmp_path: Path) -> Path:
    """A pipeline_3d checkpoint directory as the strategy writes it: ``meta.pt`` and one
    shard per stage, each stamped with its checksum (strategies/pipeline.py)."""
    d = tmp_path / "ep0.ckpt"
    d.mkdir()
    for stage in range(2):
        save_checkpoint_file({"state_dict": {"w": torch.arange(256, dtype=torch.float64) + stage}},
                             d / f"stage{stage:02d}_tp00.pt")
    save_checkpoint_file({"epoch": 0, "pipeline_3d": {"pp": 2, "tp": 1, "dp": 1}}, d / "meta.pt")
    return d


@pytest.mark.parametrize("damage", ["none", "no_meta", "corrupted_shard", "truncated_shard"])
def test_resume_of_a_pipeline_directory_is_verified_before_launch(tmp_path: Path, damage: str) -> None:
    from easgd_lightning.cli.validate import validate_config
    from easgd_lightning.utils.checkpoint import verify_checkpoint_dir

    d = _pipeline_dir(tmp_path)
    shard = d / "stage01_tp00.pt"
    overrides = ["recipe=nlp3d/gpt_tiny_pp2", f"checkpoint.resume={d}"]
    if damage == "none":
        verify_checkpoint_dir(d, "meta.pt")
        validate_config(_compose(overrides))
        return
    if damage == "no_meta":
        (d / "meta.pt").unlink()
        expected = f"checkpoint.resume: {d} is not a pipeline_3d checkpoint directory (no meta.pt)"
    elif damage == "corrupted_shard":
        _overwrite_middle(shard, count=8)
        expected = str(shard)
    else:
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        expected = f"{shard} is not a readable checkpoint"
    with pytest.raises(CheckpointError, match="no meta.pt" if damage == "no_meta" else str(shard)):
        verify_checkpoint_dir(d, "meta.pt")
    message = _resume_error(overrides)
    assert expected in message, message
