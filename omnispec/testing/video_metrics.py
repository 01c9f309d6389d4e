"""Output metrics of the LTX-2 accuracy check, as Lightricks' guard states them: cosine of tensors, relative
L2 of audio, PSNR and per-frame SSIM of decoded video."""

from __future__ import annotations

import math

import numpy as np
import torch


def cosine(a, b) -> float:
    a, b = (torch.as_tensor(x).detach().double().flatten() for x in (a, b))
    return float(torch.dot(a, b) / (a.norm() * b.norm()))


def relative_l2(ours, reference) -> float:
    """``||ours - reference|| / ||reference||``."""
    ours, reference = np.asarray(ours, np.float64), np.asarray(reference, np.float64)
    return float(np.linalg.norm(ours - reference) / np.linalg.norm(reference))


def psnr(ours, reference, peak: float = 255.0) -> float:
    """Over the whole clip, both in [0, peak]."""
    mse = float(np.mean((np.asarray(ours, np.float64) - np.asarray(reference, np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(peak * peak / mse)


def ssim_per_frame(ours, reference, peak: float = 255.0) -> np.ndarray:
    """SSIM of each frame (Wang et al. 2004: 11x11 Gaussian window, sigma 1.5, K1 0.01, K2 0.03, valid region),
    averaged over the RGB channels. Frames are (F, H, W, C) in [0, peak]."""
    x = torch.as_tensor(np.asarray(ours, np.float64)).permute(0, 3, 1, 2)
    y = torch.as_tensor(np.asarray(reference, np.float64)).permute(0, 3, 1, 2)
    taps = torch.exp(-((torch.arange(11, dtype=torch.float64) - 5) ** 2) / (2 * 1.5 ** 2))
    taps = taps / taps.sum()
    channels = x.shape[1]
    window = (taps[:, None] * taps[None, :]).expand(channels, 1, 11, 11)

    def blur(t):
        return torch.nn.functional.conv2d(t, window, groups=channels)

    mx, my = blur(x), blur(y)
    vx, vy, cov = blur(x * x) - mx * mx, blur(y * y) - my * my, blur(x * y) - mx * my
    c1, c2 = (0.01 * peak) ** 2, (0.03 * peak) ** 2
    ssim = ((2 * mx * my + c1) * (2 * cov + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
    return ssim.mean(dim=(1, 2, 3)).numpy()
