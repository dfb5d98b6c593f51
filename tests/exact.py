"Exact references for tests: transformers' own warpers on plain forwards and brute-force enumeration (`rb_entropy`)."
import torch

from entropy_grpo.rb_entropy import enumerate_entropy, warped_logq  # noqa: F401 (the tests' references, one home)


def listed_mask(idx, V):
    "Bool [c, V] of −1-padded token-id lists idx [c, K]."
    return torch.zeros(idx.shape[0], V + 1, dtype=torch.bool).scatter(1, idx.where(idx >= 0, V), True)[:, :V]
