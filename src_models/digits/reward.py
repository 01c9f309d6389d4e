"""A reward for the embedded digits model: how sure a classifier trained on scikit-learn's digits is that a drawn
32x32 image shows the prompted digit (the GRPO example's reward, and the quality benchmark's classifier).

Needs scikit-learn (the ``examples`` extra)."""

from __future__ import annotations

import numpy as np
import torch


def to_8x8(array: np.ndarray) -> np.ndarray:
    """(N, 32, 32, 1) in [0, 1] -> (N, 8, 8) on the data set's 0..16 scale."""
    x = torch.from_numpy(array[..., 0]).unsqueeze(1)
    return (torch.nn.functional.avg_pool2d(x, 4)[:, 0] * 16.0).numpy()


def digit_classifier():
    """An SVC with probabilities, fitted to scikit-learn's 1,797 digits."""
    from sklearn.datasets import load_digits
    from sklearn.svm import SVC

    data = load_digits()
    return SVC(gamma=0.001, C=10.0, probability=True, random_state=0).fit(data.data, data.target)


def digit_reward():
    """``reward(array, digits)``: each image's probability of its prompted digit, float32 (N,)."""
    clf = digit_classifier()

    def reward(array: np.ndarray, digits: list[int]) -> torch.Tensor:
        probs = clf.predict_proba(to_8x8(array).reshape(len(array), -1))
        return torch.tensor([probs[i, d] for i, d in enumerate(digits)], dtype=torch.float32)

    return reward
