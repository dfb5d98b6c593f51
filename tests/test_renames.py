"""Renamed names keep their old name for one release: each old name still works, warns (DeprecationWarning) and gives
what the new name gives. Delete a test with its alias."""
import warnings

import pytest
import torch

from entropy_grpo.delta_entropy_is import DeltaEntropyIS, importance_config
from entropy_grpo.dr_grpo import dr_grpo_loss, group_advantages, length_normaliser
from entropy_grpo.pools import mixed_records
from entropy_grpo.rb_entropy import token_stats
from entropy_grpo.sequence_processor import GenerationConfig, SequenceProcessor, make_probe_batch

QS = ["Question: What is 1 + 2? Answer:", "Q: 40 * 3 =", "Q: 9 - 4 =", "Question: What is 7 + 7? Answer:"]


def new_name_is_silent(f):
    "f() under warnings-as-errors: the new name must not warn."
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        return f()


def test_entropies_is_surprisals(tiny):
    sp = SequenceProcessor(*tiny, GenerationConfig(top_p=0.9, max_new_tokens=6, num_generations=2))
    res, _ = sp.teacher_force_logprobs(sp.generate_batched(QS[:2], seed=0))
    with pytest.warns(DeprecationWarning, match="LogprobResults.entropies is renamed surprisals"):
        old = res.entropies
    new = new_name_is_silent(lambda: res.surprisals)
    assert torch.equal(old, new)
    torch.testing.assert_close(new[res.gen_mask], -res.logprobs[res.gen_mask])     # what the new name means


def test_length_norm_max_new_tokens_is_max_len():
    g = torch.Generator().manual_seed(0)
    lp, m = -torch.rand(2, 3, 7, generator=g, dtype=torch.float64), torch.rand(2, 3, 7, generator=g) > 0.3
    A = group_advantages(torch.randn(2, 3, generator=g, dtype=torch.float64))
    with pytest.warns(DeprecationWarning, match="length_norm='max_new_tokens' is renamed 'max_len'"):
        old = dr_grpo_loss(lp, None, A, m, 7, length_norm="max_new_tokens")
    new = new_name_is_silent(lambda: dr_grpo_loss(lp, None, A, m, 7, length_norm="max_len"))
    assert torch.equal(old, new) and not torch.equal(new, dr_grpo_loss(lp, None, A, m, 7, length_norm="sample"))
    with pytest.warns(DeprecationWarning):
        assert torch.equal(length_normaliser(m, 7, "max_new_tokens"), torch.full((2, 3), 7.0))


def test_cfg_importance_support_is_weights(fresh_tiny):
    with pytest.warns(DeprecationWarning, match=r"cfg_importance\['support'\] is renamed 'weights'"):
        cfg = importance_config({"support": "full", "lr": 1e-3})
    assert cfg == new_name_is_silent(lambda: importance_config({"weights": "full", "lr": 1e-3}))
    assert cfg["weights"] == "full"
    model, tok = fresh_tiny
    sp = SequenceProcessor(model, tok, GenerationConfig(temperature=0.9, top_p=0.95, max_new_tokens=6,
                                                        num_generations=4))
    U_seqs = sp.generate_batched(QS, seed=2)
    r = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    U = make_probe_batch(U_seqs, r, group_advantages(r), max_new_tokens=6)
    E = sp.generate_batched(QS, seed=1)
    probe = DeltaEntropyIS(model, sp.config, sequence_processor=sp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.warns(DeprecationWarning, match="renamed 'weights'"):
        old = probe.entropy_change(E, U, opt, {"support": "full", "lr": 1e-3})
    new = new_name_is_silent(lambda: probe.entropy_change(E, U, opt, {"weights": "full", "lr": 1e-3}))
    sampling = probe.entropy_change(E, U, opt, {"lr": 1e-3})
    keys = ("H_orig", "H_upd", "deltaH_true", "ess", "logw_max", "weights")
    assert [old[k] for k in keys] == [new[k] for k in keys] and new["weights"] == "full"
    assert new["logw_max"] != sampling["logw_max"]                                 # the key was read, not dropped


def test_mixed_records_k_is_per_pool(pools):
    with pytest.warns(DeprecationWarning, match=r"mixed_records\(k=\) is renamed per_pool"):
        old = mixed_records(list(pools), 1, k=3, seed=5)
    new = new_name_is_silent(lambda: mixed_records(list(pools), 1, per_pool=3, seed=5))
    assert old == new and len(new) == 6 and new != mixed_records(list(pools), 1, per_pool=2, seed=5)


def test_token_stats_compute_rb_is_rb_and_full(recwarn):
    x = torch.randn(5, 40, generator=torch.Generator().manual_seed(0))
    tokens = torch.arange(5)
    old = token_stats(x, tokens, top_p=0.9, compute_rb=True)
    assert "compute_rb" in str(recwarn.pop(DeprecationWarning).message)
    new = token_stats(x, tokens, top_p=0.9, rb=True, full=True)
    for k in ("logq", "rb", "full"): assert torch.equal(old[k], new[k])


def test_train_config_old_names_are_trls():
    "TrainConfig's names before 0.1.0 give TRL's: length_norm's values are loss_type's ('max_len' = 'dr_grpo', 'sample'"
    " = 'grpo'); the loss the loop takes is unchanged. Old keys in a saved config (a checkpoint's) map the same way."
    from entropy_grpo.training import TrainConfig, renamed_config
    old_new = [(dict(steps=3), dict(max_steps=3)), (dict(lr=1e-4), dict(learning_rate=1e-4)),
               (dict(lr_scheduler="constant"), dict(lr_scheduler_type="constant_with_warmup")),
               (dict(clip_eps=(0.2, 0.28)), dict(epsilon=0.2, epsilon_high=0.28)),
               (dict(checkpoint_every=2), dict(save_steps=2)), (dict(length_norm="sample"), dict(loss_type="grpo")),
               (dict(length_norm="max_len"), dict(loss_type="dr_grpo")),
               (dict(length_norm="realized"), dict(loss_type="realized"))]
    for old, new in old_new:
        with pytest.warns(DeprecationWarning, match="is deprecated and goes in 0.2.0"):
            cfg = TrainConfig(**old)
        assert cfg == new_name_is_silent(lambda: TrainConfig(**new)), old
    assert [TrainConfig(loss_type=t).length_norm for t in ("dr_grpo", "dapo", "grpo")] == ["max_len", "dapo", "sample"]
    assert renamed_config(dict(length_norm="sample", steps=2), warn=False) == dict(loss_type="grpo", max_steps=2)
    with pytest.raises(ValueError, match="loss_type='bnpo': expected one of"):
        TrainConfig(loss_type="bnpo")
    with pytest.raises(ValueError, match="length_norm= and loss_type= both given"):
        TrainConfig(length_norm="sample", loss_type="grpo")
