"""The option codes are written once (vcpo_kernels/options.py): the generated C++ header agrees with them and no
other C++ source writes them again, Triton names the same positions, and the fused op's packed options are
complete and refused when malformed."""

import math
import re
from pathlib import Path

import pytest
import torch

import vcpo_kernels as vk
from support.backend_check import COMPILED_BACKENDS
from vcpo_kernels import options

ROOT = Path(__file__).resolve().parents[2]


def test_generated_header_is_current():
    # Regenerate with: python tools/options_header.py > csrc/options.h
    assert (ROOT / "csrc" / "options.h").read_text() == options.cpp_header()


def test_header_lists_every_code():
    header = options.cpp_header()
    for table in (options.IS_LEVELS, options.IS_CORRECTIONS, options.LR_RULES, options.ADVANTAGES,
                  options.OPOB_WEIGHTS, options.LOSS_AGG_MODES, options.OPOB_AGGREGATIONS):
        for name, code in table.items():
            assert f"{options._camel(name)} = {code}" in header
    for names in (options.SCALAR_FIELDS, options.LOSS_CODES, options.LOSS_VALUES):
        for i, name in enumerate(names):
            assert f"k{options._camel(name)} = {i}," in header
    criteria = options.REJECTION_CRITERIA
    assert "enum class Rejection : int64_t { " + ", ".join(
        f"{options._camel(name)} = {j}" for j, name in enumerate(criteria)) + " };" in header
    assert f"constexpr int64_t kNumRejection = {len(criteria)};" in header
    for side in ("Low", "High"):  # each criterion's bound, by its LossValue name
        bounds = re.search(rf"kRejection{side}\[kNumRejection\] = {{\n(.*?)}};", header, re.S).group(1)
        assert bounds == "".join(f"  k{options._camel(name)}{side},\n" for name in criteria)


def test_generated_names_are_defined_nowhere_else():
    """csrc/options.h is the only C++ source that defines an enum, enumerator or constant it generates."""
    header = options.cpp_header()
    generated = set(re.findall(r"enum (?:class )?(\w+)", header) + re.findall(r"constexpr \w+ (\w+)", header) +
                    re.findall(r"\b(k\w+) = ", header))
    for path in sorted((ROOT / "csrc").rglob("*")):
        if path.suffix not in (".h", ".cpp", ".cuh", ".cu") or path.name == "options.h":
            continue
        text = path.read_text()
        again = sorted(name for name in generated
                       if re.search(rf"enum (class )?{name}\b|constexpr \w+ {name}\b|\b{name}\s*=[^=]", text))
        assert not again, f"{path.relative_to(ROOT)} defines {again} again: generate it from vcpo_kernels/options.py"


def test_triton_scalar_positions_are_the_fields():
    codes = pytest.importorskip("vcpo_kernels.triton.codes")
    named = {name: getattr(codes, f"SCALAR_{name.upper()}", None) for name in options.SCALAR_FIELDS}
    assert {name: None if v is None else v.value for name, v in named.items()} == {
        name: i for i, name in enumerate(options.SCALAR_FIELDS)}


def test_packed_options_by_position():
    opts = vk.PolicyLossOptions(is_level="geometric", is_correction="mask", is_threshold=2.0, is_threshold_low=0.25,
                                lr_rule="linear", advantage="rloo", clip_ratio=(0.1, 0.3), clip_ratio_c=3.0,
                                loss_agg_mode="seq-mean-token-sum-norm", reference_compat=True,
                                opob_aggregation="winsorized_mean", opob_winsorize_quantiles=(0.2, 0.7),
                                rejection=(("token_k1", 0.5, 2.0), ("seq_max_k3", None, 0.2), ("token_k1", 0.6, 3.0)))
    codes, values = opts.packed(16)
    code = dict(zip(options.LOSS_CODES, codes))
    value = dict(zip(options.LOSS_VALUES, values))
    assert len(codes) == len(options.LOSS_CODES) and len(values) == len(options.LOSS_VALUES)
    assert code == dict(is_level=2, is_correction=1, ess_on_corrected=0, lr_rule=2, advantage=2, norm_by_std=1,
                        opob_length_norm=0, opob_weight=2, loss_agg=3, opob_aggregation=2,
                        rejection=(1 << 0) | (1 << 10), opob_leave_one_out=0, trust_region=1)
    loo_codes, _ = vk.PolicyLossOptions(opob_leave_one_out=True).packed(None)
    assert dict(zip(options.LOSS_CODES, loo_codes))["opob_leave_one_out"] == 1
    sapo_codes, sapo_values = vk.PolicyLossOptions(trust_region="sapo", sapo_tau=(0.5, 2.0)).packed(None)
    assert dict(zip(options.LOSS_CODES, sapo_codes))["trust_region"] == 6
    assert [dict(zip(options.LOSS_VALUES, sapo_values))[k] for k in ("sapo_tau_pos", "sapo_tau_neg")] == [0.5, 2.0]
    assert math.isnan(value.pop("m2_threshold"))  # none given: batch_m2 forms its own
    rejection = {k: value.pop(k) for k in list(value) if k.startswith(("token_", "seq_", "batch_"))}
    assert value == pytest.approx(dict(log_threshold=math.log(2.0), log_threshold_low=math.log(0.25),
                                       ess_base_ratio=1.0, clip_low=0.1, clip_high=0.3, clip_c=3.0, norm_length=16.0,
                                       winsorize_low=0.2, winsorize_high=0.7, sapo_tau_pos=1.0, sapo_tau_neg=1.05))
    # token_k1: the intersection of its two entries, in log r; seq_max_k3: its bound; the others unbounded
    assert rejection.pop("token_k1_low") == math.log(0.6) and rejection.pop("token_k1_high") == math.log(2.0)
    assert rejection.pop("seq_max_k3_high") == 0.2 and rejection.pop("seq_max_k3_low") == 0.0
    assert len(rejection) == 20 and all(v == math.inf for k, v in rejection.items() if k.endswith("_high"))
    assert all(v == (-math.inf if "k1" in k else 0.0) for k, v in rejection.items() if k.endswith("_low"))
    _, values = vk.PolicyLossOptions().packed(None)
    off = dict(zip(options.LOSS_VALUES, values))
    assert all(math.isnan(off[k]) for k in ("clip_low", "clip_high", "clip_c", "m2_threshold"))
    assert off["norm_length"] == 0.0
    _, values = vk.PolicyLossOptions(rejection=(("batch_m2", None, 0.05),), second_moment_threshold=0.3).packed(None)
    given = dict(zip(options.LOSS_VALUES, values))
    assert given["m2_threshold"] == 0.3 and given["batch_m2_high"] == 0.05


@pytest.mark.skipif("cpu" not in COMPILED_BACKENDS, reason="the C++ extension is not built")
def test_malformed_packed_options_are_refused():
    logp = -torch.rand(6)
    args = (logp, logp.clone(), None, None, torch.tensor([0, 3, 6]), torch.rand(2), None, None, 1, None)
    codes, values = vk.PolicyLossOptions().packed(None)
    torch.ops.vcpo.policy_loss(*args, codes, values)
    with pytest.raises(RuntimeError, match="option codes"):
        torch.ops.vcpo.policy_loss(*args, codes[:-1], values)
    with pytest.raises(RuntimeError, match="option values"):
        torch.ops.vcpo.policy_loss(*args, codes, values + [0.0])
