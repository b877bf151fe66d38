"""Zonal energy spectra of forecasts and truths, WeatherBench 2's `ZonalEnergySpectrum`
(weatherbench2/derived_variables.py), and the blurring figure drawn from them.

Along each latitude circle, L values f[l] at evenly spaced longitudes, on a circle of circumference
C = 2 pi R cos(latitude) (R = 6371 km; the pole rows have C = 0):

    F[k] = (1 / L) sum_l f[l] exp(-2 pi i k l / L),     k = 0 .. L // 2      (a forward-normalised real FFT)
    S[k] = C |F[k]|^2 at k = 0,   S[k] = 2 C |F[k]|^2 for k > 0   (the negative wavenumbers folded in)

S is in (field units)^2 x metres. Parseval: sum_k S[k] = C mean_l f[l]^2, the discrete integral of f^2 around
the circle; exactly so when L is odd or F[L/2] = 0, since WeatherBench 2 doubles the Nyquist term k = L/2 as
well (kept here, so the numbers are WB2's).

Averaging: WB2's script (scripts/compute_zonal_energy_spectrum.py) averages the spectra over time and keeps
latitude. Here a spectrum is averaged over the initial times of a lead, then over the rows of a latitude band
(`band_mean`; |latitude| in [30, 60] by default, the mid-latitudes of both hemispheres, where a zonal wavenumber
is a similar length on every row: this project's choice, WB2 leaves the latitude dimension to the user).

Blurring: a forecast that smooths keeps a low RMSE but loses energy at small scales. `blurring` is the ratio
forecast / truth of the band-mean spectra, averaged over the highest quarter of the wavenumbers k >= 1 that the
truth resolves: 1 for a forecast as sharp as the truth, below 1 for a blurred one. A wavenumber is resolved when
the truth's energy there is above float32 roundoff (100 eps^2 of the total, eps = 2^-24): all of them on ERA5, the
waves' k <= 5 on the synthetic data, whose truth has no energy beyond them (a ratio there would divide the
model's small-scale noise by roundoff).
"""

from __future__ import annotations

import math

import numpy as np
import torch

EARTH_RADIUS_M = 6.371e6  # WeatherBench 2's schema.EARTH_RADIUS_M
BAND = (30.0, 60.0)  # |latitude| range (degrees) of the band mean
TOP = 0.25  # the fraction of the wavenumbers (the highest) the blurring figure averages over
ROUNDOFF = 100 * 2.0 ** -48  # energy below 100 float32 roundoffs squared of the whole field's is no signal


def circumference(latitudes) -> torch.Tensor:
    """Length (m) of each latitude circle, (H,) float64; 0 at the poles."""
    lat = torch.tensor(np.asarray(latitudes, dtype=np.float64))
    return 2 * math.pi * EARTH_RADIUS_M * torch.cos(torch.deg2rad(lat)).clamp(min=0.0)


def zonal_energy_spectrum(fields: torch.Tensor, latitudes) -> torch.Tensor:
    """S[k] of every row of `fields` (..., H, W), float64: (..., H, W // 2 + 1), wavenumber k last. `latitudes`:
    (H,) degrees of the rows; the W columns are taken to be evenly spaced over 360 degrees of longitude."""
    coefficients = torch.fft.rfft(fields.double(), dim=-1, norm="forward")
    power = coefficients.real ** 2 + coefficients.imag ** 2
    power[..., 1:] *= 2  # the negative wavenumbers (the Nyquist term too, as WB2)
    return power * circumference(latitudes).to(power.device).unsqueeze(-1)


def band_rows(latitudes, band: tuple[float, float] = BAND) -> torch.Tensor:
    """Boolean (H,) of the rows whose |latitude| lies in `band` (all rows if none does)."""
    lat = torch.tensor(np.asarray(latitudes, dtype=np.float64)).abs()
    rows = (lat >= band[0]) & (lat <= band[1])
    return rows if rows.any() else torch.ones_like(rows)


def band_mean(spectra: torch.Tensor, latitudes, band: tuple[float, float] = BAND) -> torch.Tensor:
    """Mean of row spectra (..., H, K) over the rows in the latitude band: (..., K)."""
    return spectra[..., band_rows(latitudes, band).to(spectra.device), :].mean(dim=-2)


def spectra_sums(fields: torch.Tensor, latitudes, counted: torch.Tensor | None = None,
                 band: tuple[float, float] = BAND) -> torch.Tensor:
    """Band-mean spectra of fields (B, ..., H, W) summed over the initial times B: (..., W // 2 + 1) float64, to be
    added over ranks (each holding some initial times) and divided by their count. `counted` (B,) bool leaves out
    padding samples."""
    spectra = band_mean(zonal_energy_spectrum(fields, latitudes), latitudes, band)
    return (spectra if counted is None else spectra[counted]).sum(dim=0)


def lead_spectra(fields: torch.Tensor, latitudes, band: tuple[float, float] = BAND) -> torch.Tensor:
    """Spectra of forecasts or truths (B, K, C, H, W) (initial times, leads, channels) averaged over the initial
    times and the band's rows: (K, C, W // 2 + 1) float64."""
    return spectra_sums(fields, latitudes, band=band) / fields.shape[0]


def resolved_top(truth_spectra: torch.Tensor, top: float = TOP) -> torch.Tensor:
    """Boolean (..., K): the highest `top` fraction of the wavenumbers 1 .. k_max, k_max the highest wavenumber
    where the truth's energy stands above float32 roundoff (S[k] > ROUNDOFF x sum_k S[k]); all of 1 .. K - 1
    for a truth with energy everywhere, as the atmosphere's."""
    k = torch.arange(truth_spectra.shape[-1], device=truth_spectra.device)
    above = (truth_spectra > ROUNDOFF * truth_spectra.sum(dim=-1, keepdim=True)) & (k >= 1)
    k_max = torch.where(above, k, 0).amax(dim=-1, keepdim=True)  # (..., 1)
    return (k >= 1) & (k <= k_max) & (k > k_max - torch.clamp(torch.round(k_max * top), min=1))


def blurring(forecast_spectra: torch.Tensor, truth_spectra: torch.Tensor, top: float = TOP) -> torch.Tensor:
    """Ratio forecast / truth of spectra (..., K) averaged over the highest `top` of the wavenumbers the truth
    resolves (`resolved_top`): (...); NaN where the truth has no energy above roundoff at k >= 1."""
    high = resolved_top(truth_spectra, top)
    ratio = torch.where(high, forecast_spectra / truth_spectra, 0.0)
    return ratio.sum(dim=-1) / high.sum(dim=-1)
