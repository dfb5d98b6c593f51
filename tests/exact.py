"Exact references for tests: transformers' own warpers on plain forwards, and brute-force enumeration."
import math

import torch

from entropy_grpo.rb_entropy import warped_logits


def warped_logq(model, ids, temperature, top_p, top_k=0):
    "log-softmax of transformers' warpers (`warped_logits`) on a plain, unpadded forward. ids [L] -> [L-1, V]."
    logits = model(torch.as_tensor(ids)[None]).logits[0, :-1]
    return warped_logits(logits, temperature, top_p, top_k).log_softmax(-1)


@torch.no_grad()
def enumerate_entropy(model, prompt_ids, eos, V, max_new, temperature, top_p):
    "Exact entropy (nats) of the sampled sequence distribution, by enumerating every completion."
    H, total, stack = 0.0, 0.0, [(list(prompt_ids), 0.0)]
    while stack:
        ids, lq = stack.pop()
        q = warped_logq(model, ids + [eos], temperature, top_p)[-1]      # next-token log q after `ids`
        for y in range(V):
            if q[y] == float("-inf"): continue
            lqy = lq + float(q[y])
            if y == eos or len(ids) + 1 - len(prompt_ids) == max_new:
                H -= math.exp(lqy) * lqy; total += math.exp(lqy)
            else:
                stack.append((ids + [y], lqy))
    assert abs(total - 1) < 1e-5, total
    return H


def listed_mask(idx, V):
    "Bool [c, V] of −1-padded token-id lists idx [c, K]."
    return torch.zeros(idx.shape[0], V + 1, dtype=torch.bool).scatter(1, idx.where(idx >= 0, V), True)[:, :V]
