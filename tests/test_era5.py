"""ERA5 reader against files written here in the NERSC layout, and the synthetic generator."""

import pickle

import h5py
import numpy as np
import pytest
import torch

from utils import ConfigError
from utils.weather.data.era5 import ERA5Config, ERA5Dataset
from utils.weather.data.era5_synthetic import ensure_synthetic

C, H, W = 3, 12, 20


def write_layout(root, years=(2000, 2001), steps=5, channels=C, stds=None):
    """A tiny dataset in the seed's layout: fields[t, c, h, w] = 1000*year_index + 100*t + c + h/100."""
    for split in ("train", "valid"):
        (root / split).mkdir(parents=True)
        for i, year in enumerate(years):
            t, c, h = np.meshgrid(np.arange(steps), np.arange(channels), np.arange(H), indexing="ij")
            data = (1000 * i + 100 * t + c + h / 100)[..., None].repeat(W, -1).astype(np.float32)
            with h5py.File(root / split / f"{year}.h5", "w") as f:
                f.create_dataset("fields", data=data)
    (root / "stats").mkdir()
    np.save(root / "stats" / "global_means.npy", np.zeros((1, channels, 1, 1), np.float32))
    np.save(root / "stats" / "global_stds.npy", np.full((1, channels, 1, 1), 2.0 if stds is None else stds, np.float32))
    np.save(root / "stats" / "time_means.npy", np.zeros((1, channels, H, W), np.float32))
    return root


def cfg(**kw):
    base = dict(img_size=[8, 16], channels=["a", "b", "c"], dt=1)
    base.update(kw)
    return ERA5Config(**base)


def test_pairs_are_normalized_cropped_and_indexed_across_files(tmp_path):
    ds = ERA5Dataset(write_layout(tmp_path), "train", cfg(dt=2), None)
    assert len(ds) == 2 * (5 - 2)
    x, y = ds[4]  # second file (index 1), t = 1
    assert x.shape == y.shape == (C, 8, 16) and x.dtype == torch.float32
    torch.testing.assert_close(x[1, 3, 0], torch.tensor((1000 + 100 * 1 + 1 + 0.03) / 2))
    torch.testing.assert_close(y[1, 3, 0], torch.tensor((1000 + 100 * 3 + 1 + 0.03) / 2))


def test_limit_and_lazy_handles(tmp_path):
    ds = ERA5Dataset(write_layout(tmp_path), "train", cfg(), 3)
    assert len(ds) == 3
    with pytest.raises(IndexError):
        ds[3]
    ds[0]
    assert ds._handles, "reading opens the file"
    clone = pickle.loads(pickle.dumps(ds))  # as a DataLoader worker receives it
    assert clone._handles == {} and torch.equal(clone[0][0], ds[0][0])


@pytest.mark.parametrize("kw,setting", [
    (dict(channels=["a", "b"]), "data.channels"),
    (dict(img_size=[16, 16]), "data.img_size"),
    (dict(dt=5), "data.dt"),
])
def test_mismatched_config_is_rejected(tmp_path, kw, setting):
    with pytest.raises(ConfigError) as info:
        ERA5Dataset(write_layout(tmp_path), "train", cfg(**kw), None)
    assert info.value.setting == setting


def test_truncated_and_missing_files_are_rejected(tmp_path):
    root = write_layout(tmp_path)
    path = root / "train" / "2001.h5"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ConfigError, match="truncated"):
        ERA5Dataset(root, "train", cfg(), None)
    with pytest.raises(ConfigError, match="missing split"):
        ERA5Dataset(root, "test", cfg(), None)
    (root / "stats" / "global_stds.npy").unlink()
    with pytest.raises(ConfigError, match="global_stds"):
        ERA5Dataset(root, "valid", cfg(), None)


def test_synthetic_is_deterministic_and_in_layout(tmp_path):
    a, b = ensure_synthetic(tmp_path / "a"), ensure_synthetic(tmp_path / "b")
    for rel in ("train/2016.h5", "train/2017.h5", "valid/2018.h5", "test/2019.h5"):
        with h5py.File(a / rel) as fa, h5py.File(b / rel) as fb:
            assert fa["fields"].shape[1:] == (20, 32, 64)
            np.testing.assert_array_equal(fa["fields"][:], fb["fields"][:])
    assert np.load(a / "stats" / "global_stds.npy").shape == (1, 20, 1, 1)
    size = sum(p.stat().st_size for p in a.rglob("*") if p.is_file())
    assert size < 50 * 2**20
    assert ensure_synthetic(a) == a  # reused, not regenerated
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="neither empty"):
        ensure_synthetic(tmp_path / "other")


def test_synthetic_dynamics_move(era5_root):
    """Consecutive states differ (persistence is not exact) but are strongly correlated (learnable)."""
    ds = ERA5Dataset(era5_root, "valid", ERA5Config(img_size=[32, 64]), None)
    x, y = ds[0]
    rel = ((y - x).norm() / y.norm()).item()
    corr = torch.corrcoef(torch.stack([x.flatten(), y.flatten()]))[0, 1].item()
    assert 0.05 < rel < 0.6 and corr > 0.8


# What a field in these units plausibly spans on Earth (loose: synthetic fields need only read as such).
PLAUSIBLE_RANGE = {"K": (180.0, 330.0), "Pa": (5.0e4, 1.1e5), "m/s": (-80.0, 80.0), "m^2/s^2": (-3.0e3, 2.6e5),
                   "%": (0.0, 100.0), "kg/m^2": (0.0, 80.0)}


def test_synthetic_fields_read_in_their_units(era5_root):
    from utils.weather.data.era5 import CHANNELS, nersc_channel

    with h5py.File(era5_root / "train" / "2016.h5") as f:
        fields = f["fields"][:]
    for c, name in enumerate(CHANNELS):
        low, high = PLAUSIBLE_RANGE[nersc_channel(name).units]
        assert low <= fields[:, c].min() and fields[:, c].max() <= high, name
