"""The sampling restriction (``algos.sampling``) engines sample with and the learner scores with.

Aspects under test:
- ``restrict_logits`` keeps exactly the tokens vLLM's own sampler keeps (its min-p processor and
  its top-k/top-p function, imported from the installed vllm), for each rule and combined;
- the kept distribution renormalises (masked tokens get probability 0, not -inf logits), so
  entropies and gradients stay finite; ``keep`` puts a token back with its own logit;
- nothing restricted: the same tensor comes back; out-of-range settings raise naming the setting.
"""

from __future__ import annotations

import pytest
import torch

from rljob_workers.algos.sampling import Truncation, restrict_logits
from rljob_workers.algos.stats import entropy_from_logits


def _logits(rows: int = 6, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3.0


def _vllm_kept(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    out = logits.clone()
    if min_p > 0:  # vLLM's MinPLogitsProcessor.apply, the argmax-invariant step before top-k/p
        probs = torch.softmax(out, dim=-1)
        out = out.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * min_p, float("-inf"))
    k = torch.full((out.shape[0],), top_k) if top_k else None
    p = torch.full((out.shape[0],), top_p) if top_p < 1 else None
    out = apply_top_k_top_p_pytorch(out, k, p)
    return torch.isfinite(out)


@pytest.mark.parametrize(
    ("top_k", "top_p", "min_p"),
    [(0, 0.8, 0.0), (5, 1.0, 0.0), (0, 1.0, 0.1), (7, 0.6, 0.05), (3, 0.95, 0.2), (0, 0.3, 0.0)],
)
def test_restrict_logits_keeps_the_tokens_vllm_keeps(top_k, top_p, min_p):
    for seed in range(3):
        logits = _logits(seed=seed)
        ours = restrict_logits(logits, top_k=top_k, top_p=top_p, min_p=min_p)
        kept = ours > torch.finfo(ours.dtype).min
        assert torch.equal(kept, _vllm_kept(logits, top_k, top_p, min_p))
        assert torch.equal(ours[kept], logits[kept])  # kept logits unchanged


def test_restricted_distribution_is_finite_and_renormalised():
    logits = _logits().requires_grad_(True)
    restricted = restrict_logits(logits, top_p=0.5)
    probs = torch.softmax(restricted.detach(), dim=-1)
    kept = restricted > torch.finfo(restricted.dtype).min
    assert float(probs[~kept].sum()) == 0.0
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(6))
    entropy = entropy_from_logits(restricted)
    assert bool(torch.isfinite(entropy).all())
    full = entropy_from_logits(logits.detach())
    assert bool((entropy < full).all())  # fewer tokens, less entropy
    (entropy.sum() + torch.log_softmax(restricted, -1)[:, 0].sum()).backward()
    assert logits.grad is not None and bool(torch.isfinite(logits.grad).all())


def test_keep_puts_a_token_back_with_its_own_logit():
    logits = _logits()
    least = logits.argmin(dim=-1)
    restricted = restrict_logits(logits, top_k=1, keep=least)
    rows = torch.arange(logits.shape[0])
    assert torch.equal(restricted[rows, least], logits[rows, least])
    assert int((restricted > torch.finfo(restricted.dtype).min).sum()) == 2 * logits.shape[0]


def test_unrestricted_is_the_same_tensor_and_bad_settings_raise():
    logits = _logits()
    assert restrict_logits(logits) is logits
    assert not Truncation().active and Truncation(top_k=3).active
    with pytest.raises(ValueError, match="top_p"):
        Truncation(top_p=0.0)
    with pytest.raises(ValueError, match="min_p"):
        Truncation(min_p=1.5)
