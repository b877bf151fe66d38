"""Zonal energy spectra (utils/weather/task/spectra.py, WeatherBench 2's ZonalEnergySpectrum): a pure zonal wave has
energy at its wavenumber only, Parseval's relation holds with the circle's length, the numbers match a
two-sided FFT written out with numpy, and a smoothed forecast's blurring figure is below 1."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from utils.weather.task.spectra import (
    EARTH_RADIUS_M,
    band_mean,
    blurring,
    circumference,
    lead_spectra,
    resolved_top,
    spectra_sums,
    zonal_energy_spectrum,
)

LAT = np.array([90.0, 60.0, 30.0, 0.0, -30.0, -60.0])
CIRCLE = 2 * math.pi * EARTH_RADIUS_M * np.cos(np.deg2rad(LAT))  # (H,) metres


def _rows(values: np.ndarray) -> np.ndarray:
    """The same values (W,) on every row of LAT: (H, W)."""
    return np.broadcast_to(values, (len(LAT), len(values))).copy()


def test_circumference_is_the_latitude_circle_and_zero_at_the_pole():
    got = circumference(LAT).numpy()
    assert abs(got[0]) < 1e-6 and got[3] == pytest.approx(2 * math.pi * EARTH_RADIUS_M)  # cos(90 deg) ~ 6e-17
    np.testing.assert_allclose(got[1:], CIRCLE[1:], rtol=1e-12)


@pytest.mark.parametrize("width", [64, 63])
def test_a_single_zonal_wavenumber_has_energy_there_only(width):
    """f = A cos(k0 lon + phase): S[k0] = C A^2 / 2, nothing elsewhere (the mean of f^2 times the circle)."""
    k0, amplitude = 5, 3.0
    lon = np.arange(width) * 2 * np.pi / width
    spectrum = zonal_energy_spectrum(torch.from_numpy(_rows(amplitude * np.cos(k0 * lon + 0.7))), LAT).numpy()
    assert spectrum.shape == (len(LAT), width // 2 + 1)
    want = np.zeros_like(spectrum)
    want[:, k0] = CIRCLE * amplitude ** 2 / 2
    np.testing.assert_allclose(spectrum, want, rtol=1e-9, atol=1e-9 * want.max())


def test_parseval_the_spectrum_sums_to_the_circle_times_the_mean_square():
    """Odd L: sum_k S[k] = C mean_l f^2 exactly. Even L: WB2 doubles the Nyquist term too, so the sum exceeds it by
    C |F[L/2]|^2 (documented), and equals it for a field without a Nyquist component."""
    rng = np.random.default_rng(0)
    odd = rng.normal(size=(len(LAT), 63)) + 2.0
    np.testing.assert_allclose(zonal_energy_spectrum(torch.from_numpy(odd), LAT).sum(-1).numpy(),
                               CIRCLE * (odd ** 2).mean(-1), rtol=1e-10, atol=1e-3)
    even = rng.normal(size=(len(LAT), 64))
    nyquist = (even * (-1.0) ** np.arange(64)).mean(-1)  # F[L/2]
    np.testing.assert_allclose(zonal_energy_spectrum(torch.from_numpy(even), LAT).sum(-1).numpy(),
                               CIRCLE * ((even ** 2).mean(-1) + nyquist ** 2), rtol=1e-10, atol=1e-3)
    no_nyquist = even - nyquist[:, None] * (-1.0) ** np.arange(64)
    np.testing.assert_allclose(zonal_energy_spectrum(torch.from_numpy(no_nyquist), LAT).sum(-1).numpy(),
                               CIRCLE * (no_nyquist ** 2).mean(-1), rtol=1e-10, atol=1e-3)


def test_matches_a_two_sided_fft_written_out():
    """S[k] = C (|G[k]|^2 + |G[L-k]|^2) / L^2 for 0 < k < L/2, C |G[0]|^2 / L^2 at k = 0 (G numpy's unnormalised
    FFT), and WB2's doubled Nyquist term 2 C |G[L/2]|^2 / L^2; over leading dimensions (times, channels)."""
    rng = np.random.default_rng(1)
    fields = rng.normal(size=(2, 3, len(LAT), 16))
    g = np.abs(np.fft.fft(fields, axis=-1)) ** 2 / 16 ** 2
    want = np.concatenate([g[..., :1], g[..., 1:8] + g[..., 15:8:-1], 2 * g[..., 8:9]], axis=-1) * CIRCLE[:, None]
    got = zonal_energy_spectrum(torch.from_numpy(fields).float(), LAT).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * want.max())


def test_band_mean_takes_the_mid_latitude_rows():
    spectra = (torch.arange(len(LAT), dtype=torch.float64) ** 2).view(-1, 1).expand(-1, 4)  # row j's value j^2
    assert band_mean(spectra, LAT).tolist() == [11.5] * 4  # rows 1, 2, 4, 5: |lat| in [30, 60]
    assert band_mean(spectra, LAT, band=(0.0, 10.0)).tolist() == [9.0] * 4
    assert band_mean(spectra, LAT, band=(70.0, 80.0)).tolist() == [55 / 6] * 4  # no row there: all rows


def test_the_blurring_wavenumbers_are_the_highest_quarter_the_truth_resolves():
    full = torch.ones(2, 33)  # W = 64: energy at every k = 0..32
    assert resolved_top(full).nonzero()[:, 1].tolist() == [*range(25, 33)] * 2
    banded = torch.cat([torch.full((6,), 1e6), torch.full((27,), 1e-9)])  # k <= 5 and float32 roundoff beyond
    assert resolved_top(banded).nonzero().flatten().tolist() == [5]
    assert resolved_top(banded, top=0.6).nonzero().flatten().tolist() == [3, 4, 5]
    assert not resolved_top(torch.tensor([5.0, 0.0, 0.0])).any()  # a zonally uniform truth: nothing to compare
    assert blurring(torch.ones(3), torch.tensor([5.0, 0.0, 0.0])).isnan()


def test_a_band_limited_truth_is_compared_where_it_has_energy():
    """The synthetic data's truths are waves of k <= 5: a forecast equal to them plus small-scale noise is not
    sharper than the truth by the noise over roundoff, and half the amplitude at k = 5 gives a quarter."""
    lon = np.arange(64) * 2 * np.pi / 64
    truth = sum(np.cos(k * lon + k) for k in range(1, 6)) + 250.0  # float32 roundoff of 250 beyond k = 5
    truth = torch.from_numpy(_rows(truth)).float().view(1, 1, 1, len(LAT), 64)
    noisy = truth + 1e-3 * torch.randn(truth.shape, generator=torch.Generator().manual_seed(0))
    damped = truth - 0.5 * torch.from_numpy(_rows(np.cos(5 * lon + 5))).float()
    want = lead_spectra(truth, LAT)
    assert blurring(lead_spectra(noisy, LAT), want).item() == pytest.approx(1.0, abs=1e-3)
    assert blurring(lead_spectra(damped, LAT), want).item() == pytest.approx(0.25, rel=1e-3)


def test_a_smoothed_forecast_is_blurred_and_the_truth_is_not():
    """Truths of white noise (B, K, C, H, W); a forecast smoothed along the circle by a [1, 2, 1] / 4 filter
    (gain cos^2(pi k / L), small at high k) has a blurring figure below 1, sharper noise above, the truth 1."""
    rng = np.random.default_rng(2)
    truth = torch.from_numpy(rng.normal(size=(4, 2, 3, len(LAT), 32)))
    smooth = (truth.roll(1, dims=-1) + 2 * truth + truth.roll(-1, dims=-1)) / 4
    want = lead_spectra(truth, LAT)
    assert want.shape == (2, 3, 17)
    np.testing.assert_allclose(blurring(lead_spectra(truth, LAT), want).numpy(), 1.0, rtol=1e-12)
    blurred = blurring(lead_spectra(smooth, LAT), want)
    assert blurred.shape == (2, 3) and (blurred < 0.3).all()
    assert (blurring(lead_spectra(truth + 0.5 * torch.randn_like(truth), LAT), want) > 1).all()


def test_spectra_sums_add_over_ranks_and_leave_padding_out():
    """Two ranks' sums of their initial times, one padded with a repeat, add up to the one-process mean."""
    fields = torch.randn(5, 2, 3, len(LAT), 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    padded = torch.cat([fields[3:], fields[3:4]])
    counted = torch.tensor([True, True, False])
    total = spectra_sums(fields[:3], LAT) + spectra_sums(padded, LAT, counted)
    torch.testing.assert_close(total / 5, lead_spectra(fields, LAT), rtol=1e-12, atol=0)
