"""Bad input raises ValueError naming the argument, on every backend."""

import subprocess
import sys
import textwrap

import pytest
import torch

import vcpo
import vcpo_kernels as vk
from support.backend_check import COMPILED_BACKENDS, assert_refuses_other_devices, vcpo_op_calls

ALL_BACKENDS = ["torch"] + COMPILED_BACKENDS
B, T = 4, 6


def _good():
    logp = -torch.rand(B, T)
    return dict(logp=logp, behavior_logp=logp - 0.1, mask=torch.ones(B, T, dtype=torch.bool),
                rewards=torch.rand(B), group_index=torch.tensor([0, 0, 1, 1]))


def _packed():
    logp = -torch.rand(10)
    return dict(logp=logp, behavior_logp=logp.clone(), cu_seqlens=torch.tensor([0, 3, 3, 7, 10]),
                rewards=torch.rand(4))


def _call(backend, **kw):
    logp = kw.pop("logp")
    mu = kw.pop("behavior_logp")
    return vk.policy_loss(logp, mu, backend=backend, **kw)


BAD_INPUTS = {
    "behavior_logp": lambda g: g.update(behavior_logp=g["logp"][:, :-1]),
    "behavior_logp ": lambda g: g.update(behavior_logp=g["logp"].half()),
    "behavior_logp  ": lambda g: g.update(behavior_logp=torch.zeros(B, T, dtype=torch.int64)),
    "old_logp": lambda g: g.update(old_logp=torch.zeros(B, T + 1)),
    "logp": lambda g: g.update(logp=torch.zeros(B, T, dtype=torch.int32)),
    "logp ": lambda g: g.update(logp=torch.zeros(2, B, T), behavior_logp=torch.zeros(2, B, T)),
    "mask": lambda g: g.update(mask=torch.ones(B, T + 1, dtype=torch.bool)),
    "cu_seqlens": lambda g: g.update(cu_seqlens=torch.tensor([0, B * T])),
    "rewards": lambda g: g.update(rewards=torch.rand(B + 1)),
    "rewards ": lambda g: g.update(rewards=torch.tensor([0.0, torch.nan, 1.0, 1.0])),
    "group_index": lambda g: g.update(group_index=torch.tensor([0, 0, 1, 5]), num_groups=2),
    "group_index ": lambda g: g.update(group_index=torch.tensor([0, -1, 1, 1])),
    "group_index  ": lambda g: g.update(group_index=torch.tensor([0.0, 0.0, 1.0, 1.0])),
    "grad_sq_norm": lambda g: g.update(grad_sq_norm=torch.tensor([1.0, -1.0, 1.0, 1.0])),
    "grad_sq_norm ": lambda g: g.update(grad_sq_norm=torch.tensor([1.0, torch.nan, 1.0, 1.0])),
    "advantages": lambda g: g.update(advantages=torch.zeros(B)),  # with rewards too
    "num_groups": lambda g: g.update(num_groups=0),
    "device": lambda g: g.update(behavior_logp=g["behavior_logp"].to("meta")),
    "is_level": lambda g: g.update(is_level="tokens"),
    "is_correction": lambda g: g.update(is_correction="clip"),
    "is_threshold": lambda g: g.update(is_threshold=-1.0),
    "is_threshold_low": lambda g: g.update(is_threshold_low=9.0),
    "ess_base_ratio": lambda g: g.update(ess_base_ratio=0.0),
    "lr_rule": lambda g: g.update(lr_rule="cosine"),
    "advantage": lambda g: g.update(advantage="gae"),
    "opob_scope": lambda g: g.update(opob_scope="prompt"),
    "loss_agg_mode": lambda g: g.update(loss_agg_mode="mean"),
    "clip_ratio": lambda g: g.update(clip_ratio=(0.2,)),
    "clip_ratio ": lambda g: g.update(clip_ratio=(-0.1, 0.2)),
    "clip_ratio_c": lambda g: g.update(clip_ratio_c=3.0),
    "clip_ratio_c ": lambda g: g.update(clip_ratio=(0.2, 0.2), clip_ratio_c=0.5),
    "reference_compat": lambda g: g.update(reference_compat=True, opob_truncated_weights=True),
    "norm_by_std": lambda g: g.update(norm_by_std="yes"),
    "unknown option": lambda g: g.update(is_treshold=2.0),
    "backend": lambda g: g.update(backend_override="gpu"),
}


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_names_the_argument(backend, name):
    kw = _good()
    BAD_INPUTS[name](kw)
    if "backend_override" in kw:
        backend = kw.pop("backend_override")
    with pytest.raises(ValueError, match=name.strip().split()[0].replace("unknown", "unknown option")):
        _call(backend, **kw)


PACKED_BAD = {
    "not increasing": torch.tensor([0, 3, 2, 7, 10]),
    "not ending at N": torch.tensor([0, 3, 3, 7, 9]),
    "not starting at 0": torch.tensor([1, 3, 3, 7, 10]),
    "float": torch.tensor([0.0, 3.0, 3.0, 7.0, 10.0]),
}


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("name", list(PACKED_BAD))
def test_bad_cu_seqlens(backend, name):
    kw = _packed()
    kw["cu_seqlens"] = PACKED_BAD[name]
    with pytest.raises(ValueError, match="cu_seqlens"):
        _call(backend, **kw)


def test_layout_errors():
    kw = _packed()
    kw.pop("cu_seqlens")
    with pytest.raises(ValueError, match="cu_seqlens"):
        _call("auto", **kw)
    kw = _packed()
    kw["loss_agg_mode"] = "seq-mean-token-sum-norm"
    with pytest.raises(ValueError, match="norm_length"):
        _call("auto", **kw)
    kw = _good()
    kw.pop("rewards")
    with pytest.raises(ValueError, match="rewards"):
        _call("auto", **kw)


def test_unavailable_backends_are_explained(monkeypatch):
    kw = _good()
    with pytest.raises(ValueError, match="backend='cuda' needs CUDA tensors"):
        _call("cuda", **kw)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors reach Triton only through its interpreter
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        _call("triton", **kw)
    assert "triton" not in vk.available_backends("cpu")


def test_validate_false_skips_value_checks_only():
    kw = _good()
    kw["group_index"] = torch.tensor([0, -1, 1, 1])
    with pytest.raises(ValueError, match="group_index"):
        _call("auto", **kw)
    kw = _good()
    kw["grad_sq_norm"] = torch.tensor([1.0, -1.0, 1.0, 1.0])
    _call("auto", validate=False, **kw)  # the value check is off; the shape checks stay on
    kw["rewards"] = torch.rand(3)
    with pytest.raises(ValueError, match="rewards"):
        _call("auto", validate=False, **kw)


def test_standalone_op_errors():
    with pytest.raises(ValueError, match="seq_log_weight"):
        vk.effective_sample_size(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="lr_rule"):
        vk.effective_sample_size(torch.zeros(3), lr_rule="exp")
    with pytest.raises(ValueError, match="length_norm"):
        vk.opob_baseline(torch.zeros(3), torch.zeros(3), length_norm=True)
    with pytest.raises(ValueError, match="group_index"):
        vk.opob_baseline(torch.zeros(3), torch.zeros(3), group_index=torch.tensor([0, 1, 2]), num_groups=2)


def test_config_errors():
    with pytest.raises(ValueError, match="backend"):
        vcpo.VCPOConfig(backend="tpu")
    with pytest.raises(ValueError, match="is_threshold"):
        vcpo.VCPOConfig(is_threshold=float("nan"))
    with pytest.raises(ValueError, match="rule"):
        vcpo.ess_lr_scale(0.5, rule="cube")
    with pytest.raises(ValueError, match="ess_ratio"):
        vcpo.ess_lr_scale(-0.5)


def test_every_kernel_refuses_a_tensor_on_another_device():
    # The CPU kernels and the CUDA ones share these checks (csrc/entry_points.h): a tensor on another device than
    # the op's would be indexed through a foreign pointer. Meta tensors stand in for the other device here.
    calls = vcpo_op_calls("cpu", "cpu")
    assert {op.__name__.split(".")[0] for op in calls} == {
        "sequence_stats", "effective_sample_size", "opob_baseline", "policy_loss", "policy_loss_backward",
        "logit_rows_forward", "logit_rows_backward"}
    assert assert_refuses_other_devices(calls, "cpu", "meta") >= 30


def test_an_extension_built_for_another_torch_is_refused_by_name():
    # A stale build beside a new torch must not load (its symbols would not match): a warning and an error
    # naming both versions and the rebuild command, and backend="auto" falls back to the reference.
    code = textwrap.dedent("""
        import sys, types, warnings
        sys.modules["vcpo_kernels._build"] = types.SimpleNamespace(TORCH_VERSION="2.0.0")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import torch, vcpo_kernels as vk
        assert any("built against torch 2.0.0" in str(w.message) for w in caught), [str(w.message) for w in caught]
        assert "cpu" not in vk.available_backends("cpu")
        try:
            vk.policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), rewards=torch.zeros(2), backend="cpu")
        except ValueError as exc:
            assert "2.0.0" in str(exc) and torch.__version__ in str(exc) and "--no-build-isolation" in str(exc)
        else:
            raise AssertionError("backend='cpu' ran a mismatched extension")
        print("refused")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "refused" in out.stdout, out.stderr[-2000:]
