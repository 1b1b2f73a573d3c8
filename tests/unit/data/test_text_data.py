"""Byte-level text data: the standard-library corpus is deterministic and real; splits are
disjoint and contiguous; a user's own file or directory replaces it."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from easgd_lightning.data.text import (
    ByteWindowDataset,
    TextDataModule,
    load_corpus_bytes,
    stdlib_source_files,
)


def test_stdlib_corpus_is_sorted_real_python_without_site_packages():
    files = stdlib_source_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = [f.relative_to(root).as_posix() for f in files]
    assert len(files) > 100 and rel == sorted(rel)
    assert not any("site-packages" in r or "dist-packages" in r for r in rel)
    assert "os.py" in rel
    first = load_corpus_bytes(max_bytes=4096)
    assert torch.equal(first, load_corpus_bytes(max_bytes=4096))  # deterministic
    assert bytes(first[:64].tolist()) == files[0].read_bytes()[:64]


def test_windows_are_next_byte_pairs():
    tokens = torch.arange(0, 21, dtype=torch.uint8)
    ds = ByteWindowDataset(tokens, seq_len=4)
    assert len(ds) == 5
    x, y = ds[1]
    assert x.tolist() == [4, 5, 6, 7] and y.tolist() == [5, 6, 7, 8]
    assert x.dtype == torch.long


def test_split_is_disjoint_tail(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_bytes(bytes(range(256)) * 8)  # 2048 bytes
    dm = TextDataModule(path=str(text), seq_len=16, batch_size=4, val_fraction=0.25)
    dm.setup()
    n_train, n_val = len(dm._train), len(dm._val)
    assert n_train + n_val == (2049 - 1) // 16  # the file plus its trailing newline
    last_train_target = dm._train[n_train - 1][1][-1]
    first_val_input = dm._val[0][0][0]
    assert int(first_val_input) == int(last_train_target)  # the split is contiguous
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])


def test_user_directory_and_errors(tmp_path):
    (tmp_path / "b.txt").write_text("bbbb")
    (tmp_path / "a.txt").write_text("aaaa")
    (tmp_path / "skip.bin").write_bytes(b"zz")
    data = load_corpus_bytes(tmp_path, glob="*.txt")
    assert bytes(data.tolist()) == b"aaaa\nbbbb\n"
    with pytest.raises(ValueError, match="data.path"):
        load_corpus_bytes(tmp_path / "missing")
    with pytest.raises(ValueError, match="data.glob"):
        load_corpus_bytes(tmp_path, glob="*.md")
    with pytest.raises(ValueError, match="data.seq_len"):
        TextDataModule(seq_len=0)
    with pytest.raises(ValueError, match="data.val_fraction"):
        TextDataModule(val_fraction=1.0)
