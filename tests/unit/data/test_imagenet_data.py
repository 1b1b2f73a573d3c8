"""ImageNet / synthetic data modules, the tree check, resolvers and the epoch-based schedules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from easgd_lightning.data.imagenet import ImageNetDataModule, check_imagefolder_root
from easgd_lightning.data.loaders import loader_start_method
from easgd_lightning.data.synthetic import SyntheticImageDataModule, SyntheticImageDataset


def _tree(root: Path, classes=("a", "b"), per_class: int = 2, val_classes=None) -> Path:
    from PIL import Image

    for split, names in (("train", classes), ("val", val_classes or classes)):
        for c in names:
            folder = root / split / c
            folder.mkdir(parents=True)
            for i in range(per_class):
                Image.new("RGB", (50 + 7 * i, 40), color=(40 * i, 90, 200)).save(folder / f"{i}.JPEG")
    return root


# ----------------------------------------------------------------------------- tree check
def test_good_tree_lists_classes(tmp_path: Path) -> None:
    assert check_imagefolder_root(_tree(tmp_path / "t")) == ["a", "b"]


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda r: None, "data.root is not set"),
        (lambda r: r / "missing", "does not exist"),
        (lambda r: (r / "file").write_text("x") and r / "file", "is not a directory"),
        (lambda r: (r / "t" / "train").mkdir(parents=True) or r / "t", "has no val/ folder"),
        (lambda r: [(r / "t" / s).mkdir(parents=True) for s in ("train", "val")] and r / "t", "no class folders"),
    ],
)
def test_bad_roots_name_data_root_and_the_layout(tmp_path: Path, make, message: str) -> None:
    with pytest.raises(ValueError) as err:
        check_imagefolder_root(make(tmp_path))
    text = str(err.value)
    assert "data.root" in text and message in text
    assert "<data.root>/train/<class>/<image>" in text and "\n" not in text


def test_empty_class_folder_and_mismatched_classes(tmp_path: Path) -> None:
    root = _tree(tmp_path / "t")
    (root / "train" / "c").mkdir()
    with pytest.raises(ValueError, match=r"train/c/ holds no image files"):
        check_imagefolder_root(root)
    other = _tree(tmp_path / "u", classes=("a", "b"), val_classes=("a", "z"))
    with pytest.raises(ValueError, match=r"different class folders .*only in train: \['b'\].*only in val: \['z'\]"):
        check_imagefolder_root(other)


def test_datamodule_checks_at_construction(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="data.root"):
        ImageNetDataModule(root=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="data.num_classes=5"):
        ImageNetDataModule(root=str(_tree(tmp_path / "t")), num_classes=5)
    with pytest.raises(ValueError, match="data.resize_size"):
        ImageNetDataModule(synthetic=True, image_size=64, resize_size=32)
    with pytest.raises(ValueError, match="data.batch_size"):
        ImageNetDataModule(synthetic=True, batch_size=0)


# ----------------------------------------------------------------------------- real files
def test_imagefolder_batches_have_the_configured_shape(tmp_path: Path) -> None:
    dm = ImageNetDataModule(root=str(_tree(tmp_path / "t", per_class=3)), batch_size=2, image_size=24,
                            num_workers=0, train_eval_size=2)
    assert dm.num_classes == 2 and dm.pin_memory is torch.cuda.is_available()
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (2, 3, 24, 24) and x.dtype == torch.float32 and y.dtype == torch.int64
    xv, yv = next(iter(dm.val_dataloader()))
    assert xv.shape[1:] == (3, 24, 24)
    assert len(dm.train_dataloader()) == 3  # 6 images, batch 2, drop_last
    # train_eval: a strided subset across classes, unaugmented (deterministic)
    (a, ya), = list(dm.train_eval_dataloader())
    (b, yb), = list(dm.train_eval_dataloader())
    assert torch.equal(a, b) and ya.tolist() == [0, 1]


def test_forked_loader_workers(tmp_path: Path) -> None:
    dm = ImageNetDataModule(root=str(_tree(tmp_path / "t")), batch_size=2, image_size=16, num_workers=1)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert loader.persistent_workers and loader.num_workers == 1
    assert next(iter(loader))[0].shape == (2, 3, 16, 16)


def test_loader_start_method() -> None:
    import multiprocessing

    expected = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
    assert loader_start_method(None) == expected
    assert loader_start_method("spawn") == "spawn"
    with pytest.raises(ValueError, match="data.multiprocessing_context"):
        loader_start_method("teleport")


# ----------------------------------------------------------------------------- synthetic
def test_synthetic_samples_are_deterministic_and_split_apart() -> None:
    a = SyntheticImageDataset(10, image_size=8, num_classes=1000, seed=3)
    b = SyntheticImageDataset(10, image_size=8, num_classes=1000, seed=3)
    v = SyntheticImageDataset(10, image_size=8, num_classes=1000, seed=3, split="val")
    assert torch.equal(a[4][0], b[4][0]) and a[4][1] == b[4][1]
    assert not torch.equal(a[4][0], a[5][0])
    assert not torch.equal(a[4][0], v[4][0])
    assert a[0][0].shape == (3, 8, 8)
    assert all(0 <= a[i][1] < 1000 for i in range(10))
    with pytest.raises(IndexError):
        a[10]


def test_imagenet_synthetic_has_imagenet_shape_and_classes() -> None:
    dm = ImageNetDataModule(synthetic=True, batch_size=4, image_size=32, train_size=16,
                            val_size=8, num_workers=0)
    assert dm.num_classes == 1000 and dm.root is None
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 3, 32, 32)
    assert len(dm.train_dataloader()) == 4 and len(dm.val_dataloader()) == 2
    assert ImageNetDataModule(synthetic=True).train_size == 1_281_167


def test_synthetic_datamodule_validates_sizes() -> None:
    with pytest.raises(ValueError, match="data.train_size"):
        SyntheticImageDataModule(train_size=0)
    dm = SyntheticImageDataModule(batch_size=8, image_size=12, num_classes=7, train_size=20, val_size=5,
                                  train_eval_size=6)
    dm.setup("fit")
    assert len(dm.train_dataloader()) == 2
    assert sum(len(y) for _, y in dm.train_eval_dataloader()) == 6


# ----------------------------------------------------------------------------- resolvers
def test_linear_scaling_rule_and_bf16_choice() -> None:
    from omegaconf import OmegaConf

    from easgd_lightning.cli.resolvers import cpu_bf16_native, linear_scaled_lr, register_resolvers

    assert linear_scaled_lr(0.1, 256, 8192) == pytest.approx(3.2)  # Goyal et al.: 8k -> 3.2
    with pytest.raises(ValueError):
        linear_scaled_lr(0.1, 256, 0)
    register_resolvers()
    register_resolvers()  # idempotent
    cfg = OmegaConf.create({
        "data": {"batch_size": 32}, "trainer": {"devices": 8, "num_nodes": 4},
        "lr": "${linear_lr:0.1,256}", "world": "${world_size:}", "precision": "${bf16_if_supported:}",
    })
    assert cfg.lr == pytest.approx(0.4) and cfg.world == 32
    assert cfg.precision == ("bf16-mixed" if cpu_bf16_native() else "32-true")


# ----------------------------------------------------------------------------- schedules
def _module(**optim):
    from easgd_lightning.models import ClassifierModule

    return ClassifierModule(torch.nn.Linear(2, 2), lr=1.0, **optim)


def test_multistep_and_step_factors() -> None:
    m = _module(schedule="multistep", milestones=[3, 5], gamma=0.5, warmup_steps=2)
    m.resolved_schedule = m._resolve_schedule()
    assert [m._lr_factor(s) for s in range(7)] == [0.5, 1.0, 1.0, 0.5, 0.5, 0.25, 0.25]
    m = _module(schedule="step", step_size=2, gamma=0.1)
    m.resolved_schedule = m._resolve_schedule()
    assert [round(m._lr_factor(s), 6) for s in range(5)] == [1.0, 1.0, 0.1, 0.1, 0.01]


def test_schedule_options_are_checked() -> None:
    with pytest.raises(ValueError, match="optim.schedule"):
        _module(schedule="poly")
    with pytest.raises(ValueError, match="optim.milestones"):
        _module(schedule="multistep")
    with pytest.raises(ValueError, match="optim.warmup_epochs"):
        _module(warmup_epochs=-1)
    m = _module(schedule="step", step_size_epochs=3)
    with pytest.raises(ValueError, match="need a Trainer"):
        m._resolve_schedule()
