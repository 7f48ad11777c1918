"""vcpo.MicroBatchFit: the micro-batch sizes of its measured steps, its fit recomputed from the peaks it measured,
the size it picks for a budget against the rule, and every update equal to vcpo.step's at the sizes it used; the
peak of a CPU step measured from the resident set; bad inputs refused."""

import copy
import math

import pytest
import torch

import vcpo
from support.tiny_models import tiny_llama

# a large vocabulary: the logits make a micro-batch's memory (about 0.6 MiB a token in float64) stand far above
# the resident set's noise (tens of MiB from step to step on a CPU)
B, T, GROUP, VOCAB = 12, 64, 4, 32768


def batch(seed=0, grouped=True, b=B):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (b, T), generator=g)
    ones = torch.ones(b, T, dtype=torch.long)
    return vcpo.RolloutBatch(ids, ones, ones * (torch.arange(T) >= 8), -torch.rand(b, T, generator=g, dtype=torch.float64)
                             - 7, torch.rand(b, generator=g, dtype=torch.float64),
                             group_index=torch.arange(b) // GROUP if grouped else None,
                             num_groups=b // GROUP if grouped else None)


def model(vocab=VOCAB):
    return tiny_llama(hidden_size=64, intermediate_size=128, vocab_size=vocab, max_position_embeddings=T)


def sgd(m):
    return torch.optim.SGD(m.parameters(), lr=1e-2)


@pytest.mark.slow  # about 11 s: the large vocabulary's steps in float64
def test_measures_fits_and_picks_the_largest_whole_groups_the_budget_holds():
    net, twin = model(), model()
    fit, opt, twin_opt = vcpo.MicroBatchFit(budget_gib=1000), sgd(net), sgd(twin)
    config = vcpo.VCPOConfig()
    sizes = []
    for s in range(3):
        fit.step(net, opt, batch(s), config)
        sizes.append(fit.size)
    assert sizes == [GROUP, GROUP, 2 * GROUP]
    (n1, t1, s1, p1), (n2, t2, s2, p2) = fit.points
    assert (n1, t1, n2, t2) == (GROUP, GROUP * T, 2 * GROUP, 2 * GROUP * T) and 0 < s1 < p1 and 0 < s2 < p2
    # the peaks are the resident set's: the larger micro-batch's activations and logits (float64) show
    assert p2 > p1 > 0 and fit.per_token == (p2 - p1) / (t2 - t1) > 8 * VOCAB / 2
    assert math.isclose(fit.fixed + fit.per_token * t1, p1)

    def size_for(budget_bytes):  # the rule, from the fit
        groups = math.floor((budget_bytes * (1 - fit.margin) - fit.fixed) / (fit.per_token * T * GROUP))
        return None if groups * GROUP >= B else GROUP * groups

    cases = [(fit.fixed + fit.per_token * 2 * GROUP * T) / (1 - fit.margin) * 1.001,  # two groups, just
             (fit.fixed + fit.per_token * 1.5 * GROUP * T) / (1 - fit.margin),  # one and a half: one
             1000 * vcpo.memory.GIB]  # everything: the whole batch
    for s, budget in enumerate(cases, start=3):
        fit.budget = budget
        fit.step(net, opt, batch(s), config)
        assert fit.size == size_for(budget) == [2 * GROUP, GROUP, None][s - 3]
        sizes.append(fit.size)
    assert "MiB a padded token" in fit.describe()
    for s, size in enumerate(sizes):  # the same updates as vcpo.step at those sizes
        vcpo.step(twin, twin_opt, batch(s), config.replace(micro_batch_size=size))
    for a, b in zip(net.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    fit.budget = fit.fixed  # nothing left for any token: one group, with a warning
    with pytest.warns(UserWarning, match="one prompt group .4 sequences x 64 columns. needs about"):
        fit.step(net, opt, batch(6), config)
    assert fit.size == GROUP
    fit.per_token, fit.budget = None, p2 / (1 - fit.margin)  # no cost measured: the larger measured size within
    fit.step(net, opt, batch(7), config)
    assert fit.size == 2 * GROUP


@pytest.mark.slow  # about 6 s, as above
def test_two_groups_are_not_measured_where_step_2_says_they_would_not_fit():
    net = model()
    fit, opt = vcpo.MicroBatchFit(budget_gib=1000), sgd(net)
    for s in range(2):
        fit.step(net, opt, batch(s))
    _, t1, s1, p1 = fit.points[0]
    two_groups = p1 + (p1 - s1) / t1 * (2 * GROUP * T - t1)  # what step 2 added, twice, over its start
    fit.budget = two_groups / (1 - fit.margin) * 0.999
    fit.step(net, opt, batch(2))
    assert fit.size == GROUP and fit.points[1][:2] == (GROUP, GROUP * T)
    assert fit.per_token == (p1 - s1) / t1 and fit.fixed == s1  # the fit from step 2 alone
    fit.step(net, opt, batch(3))
    assert fit.size == GROUP


def test_a_batch_of_one_group_is_always_whole():
    net = model(vocab=64)
    fit, opt = vcpo.MicroBatchFit(budget_gib=1), sgd(net)
    for s in range(4):
        fit.step(net, opt, batch(s, grouped=False), vcpo.VCPOConfig(advantage="grpo", grad_norms="uniform"))
        assert fit.size is None
    assert "micro_batch_size the whole batch" in fit.describe()


@pytest.mark.parametrize("kwargs, message", [
    (dict(budget_gib=0), "budget_gib must be a number > 0, got 0"),
    (dict(budget_gib=float("nan")), "budget_gib must be a number > 0, got nan"),
    (dict(budget_gib=True), "budget_gib must be a number > 0, got True"),
    (dict(budget_gib=8, margin=1.0), r"margin must be a number in \[0, 1\), got 1.0"),
])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        vcpo.MicroBatchFit(**kwargs)


def test_a_config_with_a_micro_batch_size_is_refused():
    net = model(vocab=64)
    with pytest.raises(ValueError, match="MicroBatchFit chooses micro_batch_size; the config sets it to 4"):
        vcpo.MicroBatchFit(budget_gib=8).step(net, sgd(net), batch(), vcpo.VCPOConfig(micro_batch_size=4))


def _fit_on_rank(rank):
    """Two ranks with two prompt groups each; after the measured steps, a fit under which rank 0's budget holds
    its whole share and rank 1's one group: both must run one group (the ranks agree on the smallest)."""
    net = model(vocab=64)
    whole = batch(b=4 * GROUP)
    rows = slice(2 * GROUP * rank, 2 * GROUP * (rank + 1))
    share = vcpo.RolloutBatch(whole.input_ids[rows], whole.attention_mask[rows], whole.loss_mask[rows],
                              whole.behavior_logp[rows], whole.rewards[rows], group_index=whole.group_index[rows],
                              num_groups=whole.num_groups)
    fit, opt = vcpo.MicroBatchFit(budget_gib=1000), sgd(net)
    sizes = []
    for _ in range(3):
        fit.step(net, opt, share, process_group=torch.distributed.group.WORLD)
        sizes.append(fit.size)
    fit.fixed, fit.per_token = 0.0, 1.0  # bytes: a group of GROUP x T tokens takes GROUP T
    fit.budget = 1000 * vcpo.memory.GIB if rank == 0 else GROUP * T / (1 - fit.margin) * 1.01
    fit.step(net, opt, share, process_group=torch.distributed.group.WORLD)
    return {"sizes": sizes + [fit.size], "params": [p.detach() for p in net.parameters()]}


def test_the_ranks_of_a_process_group_agree_on_the_smallest_size():
    from support.ranks import on_ranks

    ranks = on_ranks(_fit_on_rank)
    assert [r["sizes"] for r in ranks] == [[GROUP, GROUP, None, GROUP]] * 2  # 2 groups: the whole share at step 3
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)
